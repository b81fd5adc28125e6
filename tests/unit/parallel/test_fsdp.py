"""FSDP2 on one process: options, the default blocks, errors, and what one process does.

The sharding itself (several processes) is tested in tests/multiproc/test_fsdp_training.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.errors import AccelError, ConfigError, StaleParametersError
from accel.parallel import fsdp
from accel.parallel.fsdp_params import (
    adopt_sharded_parameters,
    check_optimizer_parameters,
    mark_replaced,
    plain_norm,
)
from accel.precision.casting import AutocastForward
from accel.precision.registry import precision_for


@contextmanager
def fake(**fields: Any) -> Iterator[ProcessState]:
    with set_state(ProcessState(**fields), Scope()) as st:
        yield st


class Block(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.small = nn.ModuleList([nn.Linear(4, 1)])
        self.blocks = nn.ModuleList([Block(), Block(), nn.ReLU()])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# -- options ------------------------------------------------------------------------------
def test_defaults_and_precedence() -> None:
    options = fsdp.fsdp_options({}, {})
    assert options == fsdp.FSDPOptions(None, True, False, ())
    run = {"cpu_offload": True, "reshard_after_forward": False, "find_unused_parameters": True}
    merged = fsdp.fsdp_options(run, {"reshard_after_forward": True, "shard_modules": Block})
    assert merged.cpu_offload is True  # from accel.distributed(**options)
    assert merged.reshard_after_forward is True  # prepare_model's value wins
    assert merged.shard_modules == (Block,)
    assert merged.given == ("shard_modules", "reshard_after_forward", "cpu_offload")
    # a class, a name, or an iterable of them
    assert fsdp.fsdp_options({}, {"shard_modules": "Block"}).shard_modules == ("Block",)
    both = fsdp.fsdp_options({}, {"shard_modules": ("Block", nn.Linear)})
    assert both.shard_modules == ("Block", nn.Linear)
    assert fsdp.fsdp_options({}, {"shard_modules": None}).shard_modules is None


def test_unknown_option_names_it_and_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        fsdp.fsdp_options({}, {"find_unused_parameters": True})  # a DDP option
    message = str(info.value)
    assert "'find_unused_parameters'" in message
    assert "['shard_modules', 'reshard_after_forward', 'cpu_offload']" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, AccelError)
    with fake(), pytest.raises(ConfigError, match="'reshard_after_forwards'"):
        accel.prepare_model(Net(), strategy="fsdp", reshard_after_forwards=False)
    with fake(), pytest.raises(ConfigError, match="unknown DDP option 'shard_modules'"):
        accel.prepare_model(Net(), strategy="ddp", shard_modules=Block)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"cpu_offload": "yes"}, "cpu_offload='yes'"),
        ({"reshard_after_forward": 1}, "reshard_after_forward=1"),
        ({"shard_modules": 3}, "shard_modules=3"),
        ({"shard_modules": [Block, 3.5]}, "3.5 is neither"),
        ({"shard_modules": [torch.Tensor]}, "Tensor"),
        ({"shard_modules": ""}, "shard_modules=''"),
        ({"shard_modules": []}, "is empty"),
    ],
)
def test_invalid_values(given: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        fsdp.fsdp_options({}, given)
    assert expected in str(info.value)


def test_invalid_run_option_names_its_origin() -> None:
    with pytest.raises(ConfigError, match=r"accel\.distributed\(\): .*cpu_offload='no'"):
        fsdp.fsdp_options({"cpu_offload": "no"}, {})


# -- which modules are sharded ------------------------------------------------------------
def test_default_is_the_blocks_of_the_largest_container() -> None:
    net = Net()
    assert fsdp.default_shard_modules(net) == [net.blocks[0], net.blocks[1]]  # not ReLU
    assert fsdp.shard_targets(net, None) == [net.blocks[1], net.blocks[0]]  # deepest first
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert fsdp.default_shard_modules(seq) == [seq[0], seq[2]]  # the root itself counts
    assert fsdp.shard_targets(nn.Linear(2, 2), None) == []  # no container: the root alone
    empty = nn.Module()
    empty.acts = nn.ModuleList([nn.ReLU()])
    assert fsdp.default_shard_modules(empty) == []


def test_shard_modules_by_class_or_name_children_first() -> None:
    outer = nn.Sequential(Block(), nn.Sequential(Block(), nn.Linear(4, 4)))
    by_class = fsdp.shard_targets(outer, (Block,))
    assert by_class == [outer[1][0], outer[0]]
    assert fsdp.shard_targets(outer, ("Block",)) == by_class
    nested = fsdp.shard_targets(outer, ("Sequential", nn.Linear))
    # every Linear comes before the Sequential holding it; the root is never a target
    assert nested.index(outer[1][1]) < nested.index(outer[1])
    assert nested.index(outer[1][0].lin) < nested.index(outer[1])
    assert outer not in nested


def test_absent_class_names_it_and_lists_the_classes_present() -> None:
    net = Net()
    for spec, shown in ((nn.Conv2d, "'Conv2d'"), ("Attention", "'Attention'")):
        with pytest.raises(ConfigError) as info:
            fsdp.shard_targets(net, ("Block", spec))
        message = str(info.value)
        assert shown in message
        assert "['Block', 'Linear', 'ModuleList', 'Net', 'ReLU']" in message
    # checked on one process too: the same script fails the same way on 1 and N
    with fake(), pytest.raises(ConfigError, match="'Attention'"):
        accel.prepare_model(Net(), strategy="fsdp", shard_modules="Attention")


def test_mixed_precision_policy() -> None:
    assert precision_for("no").fsdp_policy() is None
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                        ("fp8", torch.bfloat16)):
        policy = precision_for(name).fsdp_policy()
        assert (policy.param_dtype, policy.reduce_dtype) == (dtype, dtype)
        assert policy.output_dtype is None  # the autocast wrapper returns fp32


# -- one process ---------------------------------------------------------------------------
def test_one_process_runs_unsharded_with_a_note_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="accel.parallel.fsdp")
    with fake(strategy="fsdp", mixed_precision="bf16"):
        net = Net()
        model = accel.prepare_model(net, shard_modules=Block)
        assert model is net and not fsdp.is_fsdp_module(model)
        assert isinstance(net.__dict__["forward"], AutocastForward)
        assert model(torch.ones(2, 3)).dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in net.parameters())
        assert accel.unwrap_model(model) is net
        accel.prepare_model(Net())
    notes = [r for r in caplog.records if "one process" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    # evaluation_mode: no sharding, no note
    with fake(strategy="fsdp", world_size=2):  # no process group: sharding would fail
        frozen = Net()
        assert accel.prepare_model(frozen, evaluation_mode=True) is frozen


def test_one_process_training_with_the_prepare_order_of_accelerate() -> None:
    with fake(strategy="fsdp"):
        net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        model, prepared = accel.prepare(net, optimizer)
        accel.backward(model(torch.ones(2, 3)).sum())
        norm = accel.clip_grad_norm_(model.parameters(), 1.0)
        assert type(norm) is torch.Tensor
        before = net.head.weight.detach().clone()
        prepared.step()
        assert not torch.equal(before, net.head.weight)


def test_strategy_reaches_the_state_from_env_and_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCEL_STRATEGY", "fsdp")  # what `accel launch --strategy fsdp` sets
    with accel.distributed() as st:
        assert st.strategy == "fsdp"
        net = Net()
        assert accel.prepare(net) is net
    monkeypatch.delenv("ACCEL_STRATEGY")
    config = tmp_path / "config.toml"
    config.write_text('strategy = "fsdp"\n')
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    with accel.distributed(shard_modules="Block", cpu_offload=True) as st:
        assert st.strategy == "fsdp"
        assert fsdp.fsdp_options(st.options, {}).shard_modules == ("Block",)


# -- optimizers holding replaced parameters -----------------------------------------------
def _replace_all(model: nn.Module) -> dict[str, nn.Parameter]:
    """Stand-in for fully_shard: swap every parameter for a new one, marking the old ones."""
    before = dict(model.named_parameters())
    for name, param in before.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(param.detach().clone()))
    mark_replaced(model, before)
    return before


def test_an_optimizer_made_before_sharding_is_refused() -> None:
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters())
    _replace_all(net)
    with pytest.raises(StaleParametersError) as info:
        check_optimizer_parameters(optimizer)
    message = str(info.value)
    assert "'AdamW'" in message and "'Net'" in message and "'inp.weight'" in message
    assert "accel.prepare(model, optimizer)" in message
    assert isinstance(info.value, ValueError)
    with fake(), pytest.raises(StaleParametersError):
        accel.prepare_optimizer(optimizer)
    with fake(), pytest.raises(StaleParametersError):
        accel.prepare(optimizer)  # its model is not in the call: nothing to remap to
    check_optimizer_parameters(torch.optim.AdamW(net.parameters()))  # made after: fine


def test_prepare_together_moves_the_optimizer_onto_the_new_parameters() -> None:
    net, other = Net(), Net()
    optimizer = torch.optim.AdamW(
        [{"params": list(net.parameters())}, {"params": list(other.parameters()), "lr": 0.5}]
    )
    _replace_all(net)
    _replace_all(other)
    adopt_sharded_parameters(optimizer, [net])
    assert optimizer.param_groups[0]["params"] == list(net.parameters())
    with pytest.raises(StaleParametersError):  # `other` was not in the call
        check_optimizer_parameters(optimizer)
    adopt_sharded_parameters(optimizer, [other])
    assert optimizer.param_groups[1]["params"] == list(other.parameters())
    assert optimizer.param_groups[1]["lr"] == 0.5
    check_optimizer_parameters(optimizer)


def test_an_optimizer_with_state_for_replaced_parameters_is_not_remapped() -> None:
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    _replace_all(net)
    with pytest.raises(StaleParametersError, match="already has state for parameter"):
        adopt_sharded_parameters(optimizer, [net])


def test_plain_norm() -> None:
    norm = torch.tensor(2.0)
    assert plain_norm(norm) is norm

    class Replicated(torch.Tensor):
        def full_tensor(self) -> torch.Tensor:
            return torch.tensor(3.0)

    assert plain_norm(torch.tensor(1.0).as_subclass(Replicated)).item() == 3.0

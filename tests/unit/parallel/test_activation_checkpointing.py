"""Activation checkpointing and regional compilation on one process (accel/parallel/blockwise.py).

Several processes (DDP, FSDP) are tested in
tests/multiproc/test_activation_checkpointing_multiproc.py.
"""

from __future__ import annotations

import json
import logging
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import accel
from accel.core.setting_values import validate_setting
from accel.errors import ConfigError
from accel.parallel.blockwise import CheckpointedForward, block_targets, compile_plan
from accel.testing import run_script

WIDTH = 8


class Block(nn.Module):
    calls = 0  # forward runs, counted across instances

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.drop(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _step(model: nn.Module, net: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(5)  # the same dropout masks in every variant
    out = model(torch.randn(4, 3))
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}  # type: ignore[union-attr]


def _checkpointed(net: nn.Module) -> list[str]:
    return [
        name for name, module in net.named_modules()
        if isinstance(module.__dict__.get("forward"), CheckpointedForward)
    ]


def test_checkpointing_gives_equal_gradients_and_recomputes_each_block() -> None:
    with accel.distributed():
        plain = _net()
        want_out, want = _step(accel.prepare_model(plain), plain)
        net = _net()
        names = list(net.state_dict())
        params = [n for n, _ in net.named_parameters()]
        model = accel.prepare_model(net, activation_checkpointing=True)
        assert accel.unwrap_model(model) is net and model is net
        assert _checkpointed(net) == ["blocks.0", "blocks.1", "blocks.2"]
        hooked: list[str] = []  # hooks on a block (FSDP2's all-gather) run once, not again
        for block in net.blocks:  # in the recompute
            block.register_forward_pre_hook(lambda module, args: hooked.append("pre"))
        Block.calls = 0
        out, grads = _step(model, net)
        assert Block.calls == 6  # 3 forwards, then 3 recomputes in the backward
        assert hooked == ["pre"] * 3
        assert torch.equal(out, want_out)  # dropout included: the RNG state is replayed
        assert grads.keys() == want.keys()
        for name in want:
            assert torch.equal(grads[name], want[name]), name
        # names stay the user's: state dict, parameters, accel's full state dict
        assert list(net.state_dict()) == names
        assert [n for n, _ in net.named_parameters()] == params
        assert list(accel.get_state_dict(model)) == names
        copy = deepcopy(net)  # the wrapper follows the copy, not the original
        assert copy.blocks[0].__dict__["forward"].module is copy.blocks[0]
        Block.calls = 0
        with torch.no_grad():
            model(torch.randn(2, 3))
        net.eval()
        model(torch.randn(2, 3)).sum().backward()
        assert Block.calls == 6  # no checkpointing without grad or outside training


def test_checkpointing_under_bf16_autocast_matches_no_checkpointing() -> None:
    with accel.distributed(mixed_precision="bf16"):
        plain = _net()
        want_out, want = _step(accel.prepare_model(plain), plain)
        net = _net()
        out, grads = _step(accel.prepare_model(net, activation_checkpointing=True), net)
    assert torch.equal(out, want_out)
    for name in want:
        assert torch.equal(grads[name], want[name]), name


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x))


def test_classes_names_and_lists_pick_the_blocks_outermost_only() -> None:
    with accel.distributed():
        net = nn.Sequential(nn.Linear(3, WIDTH), Outer(), Inner(), nn.Linear(WIDTH, 1))
        accel.prepare_model(net, activation_checkpointing=[Outer, "Inner"])
        # Outer's own Inner is left to Outer: no checkpoint inside a checkpoint
        assert _checkpointed(net) == ["1", "2"]
        net = nn.Sequential(nn.Linear(3, WIDTH), Outer(), Inner())
        accel.prepare_model(net, activation_checkpointing="Inner, Linear")
        assert _checkpointed(net) == ["0", "1.inner", "2"]
        net = nn.Sequential(nn.Linear(3, WIDTH), Outer())
        accel.prepare_model(net, activation_checkpointing=Inner)
        assert _checkpointed(net) == ["1.inner"]
        assert accel.prepare_model(net, activation_checkpointing=True) is net  # prepared once


def test_invalid_values_are_config_errors_naming_them() -> None:
    with accel.distributed():
        for bad, match in (
            (3, "activation_checkpointing=3 is invalid"),
            ([], r"activation_checkpointing=\[\] names no block"),
            ("not a name", "'not a name' is neither"),
            ([Inner, 2.5], "2.5 is neither an nn.Module subclass"),
            (Outer, "names 'Outer', which occurs nowhere"),
            ("Blok", "did you mean 'Block'"),
        ):
            with pytest.raises(ConfigError, match=match):
                accel.prepare_model(Net(), activation_checkpointing=bad)
        with pytest.raises(ConfigError, match=r"True found no blocks .*'Linear'"):
            accel.prepare_model(nn.Linear(2, 2), activation_checkpointing=True)
    bad_run = r"accel.distributed\(\): activation_checkpointing=1"
    with pytest.raises(ConfigError, match=bad_run), accel.distributed(activation_checkpointing=1):
        pass
    typo = "did you mean 'activation_checkpointing'"
    with pytest.raises(ConfigError, match=typo), accel.distributed(activation_checkpoint=True):
        pass


def test_run_wide_setting_from_distributed_env_and_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('activation_checkpointing = "Block"\n')
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(config))
    with accel.distributed() as st:
        assert st.options["activation_checkpointing"] == "Block"
        net = accel.prepare_model(Net())
        assert len(_checkpointed(net)) == 3
        net = accel.prepare_model(Net(), activation_checkpointing=False)  # the argument wins
        assert _checkpointed(net) == []
    monkeypatch.setenv("ACCEL_ACTIVATION_CHECKPOINTING", "no")  # the variable wins over the file
    with accel.distributed() as st:
        assert st.options["activation_checkpointing"] is False
        assert _checkpointed(accel.prepare_model(Net())) == []
        with accel.distributed(activation_checkpointing=True):  # nested: scoped
            assert len(_checkpointed(accel.prepare_model(Net()))) == 3
    monkeypatch.setenv("ACCEL_ACTIVATION_CHECKPOINTING", "Block Inner")
    bad_variable = "ACCEL_ACTIVATION_CHECKPOINTING='Block Inner'"
    with pytest.raises(ConfigError, match=bad_variable), accel.distributed():
        pass
    monkeypatch.delenv("ACCEL_ACTIVATION_CHECKPOINTING")
    config.write_text("activation_checkpointing = 2\n")
    with pytest.raises(ConfigError, match="activation_checkpointing=2 is invalid"), \
            accel.distributed():
        pass


def test_the_setting_accepts_booleans_and_class_names() -> None:
    key = "activation_checkpointing"
    assert validate_setting(key, True) is True
    assert validate_setting(key, " Yes ") is True
    assert validate_setting(key, "off") is False
    assert validate_setting(key, "GPT2Block,MLP ") == "GPT2Block, MLP"
    for bad in ("a-b", "", 1, "Block,"):
        with pytest.raises(ConfigError, match="module class names separated by commas"):
            validate_setting(key, bad)


def test_save_and_load_state_keep_the_original_names(tmp_path: Path) -> None:
    with accel.distributed():
        net = _net()
        model = accel.prepare_model(net, activation_checkpointing=True)
        optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
        _step(model, net)
        optimizer.step()
        accel.save_state(tmp_path / "state", model=model, optimizer=optimizer)
        accel.save_model(model, tmp_path / "weights")
        names = set(Net().state_dict())
        for file in (tmp_path / "state" / "model.safetensors",
                     tmp_path / "weights" / "model.safetensors"):
            with safe_open(str(file), "pt") as opened:
                assert set(opened.keys()) == names, file
        plain = Net()  # no checkpointing: the same keys load
        plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
        accel.load_state(tmp_path / "state", model=plain, optimizer=plain_optimizer)
        for name, value in net.state_dict().items():
            assert torch.equal(plain.state_dict()[name], value), name
        again = accel.prepare_model(Net(), activation_checkpointing=True)
        accel.load_state(tmp_path / "state", model=again)
        assert torch.equal(again.head.weight, net.head.weight)


def test_transformers_blocks_are_checkpointed_with_equal_gradients(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # use_cache stays True: a checkpointed layer must not write the cache twice
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
        with accel.distributed(), caplog.at_level(logging.WARNING):
            prepared = accel.prepare_model(model, activation_checkpointing=checkpointing)
            loss = prepared(input_ids=ids, labels=ids).loss
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        if checkpointing:
            assert _checkpointed(model) == ["model.layers.0", "model.layers.1"]
    (want_loss, want), (loss, grads) = results
    assert torch.equal(loss, want_loss)
    for name in want:
        assert torch.equal(grads[name], want[name]), name  # type: ignore[arg-type]
    # transformers' own gradient checkpointing: its layers are left to it
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    with accel.distributed():
        accel.prepare_model(model, activation_checkpointing=True)
    assert _checkpointed(model) == []


def _compiled(net: nn.Module) -> list[str]:
    return [
        name for name, module in net.named_modules()
        if getattr(module, "_compiled_call_impl", None) is not None
    ]


def test_regional_compile_compiles_each_block_in_place_with_equal_results() -> None:
    with accel.distributed():
        plain = _net()
        want_out, want = _step(accel.prepare_model(plain), plain)
        net = _net()
        names = list(net.state_dict())
        # aot_eager: dynamo and AOTAutograd without inductor's C++ build (fast here)
        model = accel.prepare_model(
            net, compile={"regional": True, "backend": "aot_eager"},
            activation_checkpointing=True,
        )
        assert model is net and accel.unwrap_model(model) is net
        assert _compiled(net) == ["blocks.0", "blocks.1", "blocks.2"]
        assert _checkpointed(net) == ["blocks.0", "blocks.1", "blocks.2"]
        assert list(net.state_dict()) == names
        out, grads = _step(model, net)
        assert torch.equal(out, want_out)
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-6, atol=1e-6)
        net = nn.Sequential(nn.Linear(3, WIDTH), Outer(), Inner())
        accel.prepare_model(net, compile={"regional": "Inner", "backend": "eager"})
        assert _compiled(net) == ["1.inner", "2"]
        whole = accel.prepare_model(_net(), compile={"backend": "eager"})
        assert type(whole).__name__ == "OptimizedModule"  # compile=True: the whole model


def test_compile_values() -> None:
    assert compile_plan(False) is None and compile_plan({}) is None
    plan = compile_plan("regional")
    assert plan is not None and plan.regional is True and not plan.options
    plan = compile_plan({"regional": ["Block"], "mode": "max-autotune"})
    assert plan is not None and plan.regional == ("Block",)
    assert plan.options == {"mode": "max-autotune"}
    with accel.distributed():
        with pytest.raises(ConfigError, match=r"compile='regionl'.*did you mean 'regional'"):
            accel.prepare_model(nn.Linear(2, 2), compile="regionl")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"compile=3\) is invalid"):
            accel.prepare_model(nn.Linear(2, 2), compile=3)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"compile\['regional'\]=True found no blocks"):
            accel.prepare_model(nn.Linear(2, 2), compile="regional")
        with pytest.raises(ConfigError, match=r"compile\['regional'\] names 'Nope'"):
            accel.prepare_model(Net(), compile={"regional": "Nope"})
        with pytest.raises(ConfigError, match="'regional'"):
            block_targets(Net(), ("Nope",), key="compile['regional']")


@pytest.mark.slow
def test_regional_compile_with_inductor() -> None:
    """The default backend (inductor builds C++ on CPU: tens of seconds on a loaded machine)."""

    class Still(Net):
        def __init__(self) -> None:
            super().__init__()
            for block in self.blocks:
                block.drop.p = 0.0  # type: ignore[union-attr]  # inductor draws its own masks

    results: list[Any] = []
    for compile in (False, "regional"):
        torch.manual_seed(0)
        net = Still()
        with accel.distributed():
            model = accel.prepare_model(net, compile=compile, activation_checkpointing=True)
            results.append(_step(model, net))
    (want_out, want), (out, grads) = results
    torch.testing.assert_close(out, want_out)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.ci_extra
@pytest.mark.slow
def test_bench_smoke_run() -> None:
    bench = Path(__file__).parents[3] / "bench" / "activation_checkpointing.py"
    # as `python bench/activation_checkpointing.py ...` (raises if it fails), forked from the
    # warm workers; its measuring children are fresh interpreters, as the bench starts them
    done = run_script(bench, "--depth", "2", "--width", "32", "--pairs", "1", "--windows", "2",
                      "--steps", "1", world_size=1, launch=False, timeout=300)
    report = json.loads(done.stdout[0])
    assert report["model"]["depth"] == 2 and report["device"] == "cpu"
    (pair,) = report["memory_pairs"]
    assert 0 < pair["on_mb"] < pair["off_mb"]  # 2 blocks: still less kept for the backward
    assert report["timing"]["time_ratio"] > 0
    assert isinstance(report["goal_met"], bool)

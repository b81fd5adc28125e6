"""Checkpoints of models with tied embeddings (GPT-2 style) resume anywhere.

An FSDP ``save_state`` on 2 processes loads on 1 (plain model), 2 and 3 (FSDP) and 2 (DDP), and
the next step equals the uninterrupted run's. The tied tensor is stored once, under its first
name. ``gpt2`` runs only where transformers is installed.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
from typing import Any

import pytest
import safetensors
import torch
from torch import nn

import accel
from accel.testing import run_distributed
from tests import tied_models as tm

# the gpt2 family's workers import transformers: the warm server does it once (conftest.py)
pytestmark = pytest.mark.preload("transformers", "transformers.models.gpt2.modeling_gpt2")

STEPS = 2
FAMILIES = [
    "toy",
    pytest.param(
        "gpt2",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("transformers") is None, reason="transformers not installed"
        ),
    ),
]


def _prepared(family: str, strategy: str, seed: int) -> tuple[nn.Module, Any]:
    model = accel.prepare_model(tm.MODELS[family](seed), strategy=strategy)
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.02))
    return model, optimizer


def _step(model: nn.Module, optimizer: Any, index: int) -> float:
    st = accel.state()
    loss = tm.loss_of(model, tm.tokens(index, st.rank, st.world_size))
    accel.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(accel.reduce(loss.detach(), reduction="mean"))


def _save_body(root: str, family: str) -> dict[str, Any]:
    model, optimizer = _prepared(family, "fsdp", seed=0)
    for i in range(STEPS):
        _step(model, optimizer, i)
    path = accel.save_state(root, step=STEPS, model=model, optimizer=optimizer)
    accel.save_model(model, f"{root}/weights", max_shard_size="2KB")  # shards: one gather each
    full = accel.get_state_dict(model)
    alias, first = _ALIASES[family]
    shared = alias in full and full[alias] is full[first]  # gathered once, shared as in the model
    loss = _step(model, optimizer, STEPS)
    return {"path": str(path), "loss": loss, "next": accel.get_state_dict(model), "shared": shared}


_ALIASES = {
    "toy": ("head.weight", "embed.weight"),
    "gpt2": ("lm_head.weight", "transformer.wte.weight"),
}


def _load_body(root: str, family: str, strategy: str) -> dict[str, Any]:
    model, optimizer = _prepared(family, strategy, seed=5)
    info = accel.load_state(root, model=model, optimizer=optimizer)
    assert info is not None and info.step == STEPS
    loss = _step(model, optimizer, STEPS)
    return {"loss": loss, "next": accel.get_state_dict(model)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    # The loss before the step agrees to 1e-5; after one AdamW step, parameters whose
    # gradient is ~0 move by up to lr on summation-order noise, hence the looser bound.
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= 1e-4, worst


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    family = request.param
    root = tmp_path_factory.mktemp(f"tied-{family}")
    out = run_distributed(_save_body, str(root), family, world_size=2, timeout=120)
    return family, root, out[0]


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "strategy"), [(2, "fsdp"), (3, "fsdp"), (2, "ddp")])
@pytest.mark.ci_extra
def test_fsdp_checkpoint_of_a_tied_model_resumes(
    saved: Any, world_size: int, strategy: str
) -> None:
    family, root, uninterrupted = saved
    results = run_distributed(
        _load_body, str(root), family, strategy, world_size=world_size, timeout=120
    )
    for result in results:
        assert abs(result["loss"] - uninterrupted["loss"]) <= 1e-5
        _close(result["next"], uninterrupted["next"])


def test_fsdp_checkpoint_of_a_tied_model_loads_on_one_process(saved: Any) -> None:
    family, root, uninterrupted = saved
    model = tm.MODELS[family](seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    with pytest.warns(UserWarning, match="RNG states are not restored"):
        accel.load_state(root, model=model, optimizer=optimizer)
    loss = tm.loss_of(model, tm.tokens(STEPS))
    loss.backward()
    optimizer.step()
    assert abs(loss.item() - uninterrupted["loss"]) <= 1e-5
    _close(accel.get_state_dict(model), uninterrupted["next"])


def test_the_tied_tensor_is_stored_once_under_its_first_name(saved: Any) -> None:
    family, _, uninterrupted = saved
    path = pathlib.Path(uninterrupted["path"])
    alias, first = _ALIASES[family]
    body = json.loads((path / "model.json").read_text())
    assert alias not in body["state"] and first in body["state"]
    assert body["extra"]["tied"] == {alias: first}
    stored = set()
    for rank in (0, 1):
        with safetensors.safe_open(path / f"model__shards_rank{rank}.safetensors", "pt") as f:
            stored |= set(f.keys())
    assert alias not in stored and first in stored
    optimizer = json.loads((path / "optimizer.json").read_text())
    assert first in optimizer["state"]["state"] and alias not in optimizer["state"]["state"]


def _ddp_save_body(root: str) -> str:
    model, optimizer = _prepared("toy", "ddp", seed=0)
    for i in range(STEPS):
        _step(model, optimizer, i)
    return str(accel.save_state(root, model=model, optimizer=optimizer))


def test_ddp_checkpoint_loads_into_a_model_tied_after_loading(tmp_path: pathlib.Path) -> None:
    run_distributed(_ddp_save_body, str(tmp_path), world_size=2, timeout=120)
    assert "head.weight" not in json.loads((tmp_path / "model.json").read_text())["state"]
    tied = tm.toy(seed=5)
    tied_opt = torch.optim.AdamW(tied.parameters(), lr=0.02)
    with pytest.warns(UserWarning, match="RNG states are not restored"):
        accel.load_state(tmp_path, model=tied, optimizer=tied_opt)
    untied = tm.toy(seed=5, tie=False)  # two parameters: both take the stored tensor
    untied_opt = torch.optim.AdamW(untied.parameters(), lr=0.02)
    with pytest.warns(UserWarning, match="RNG states are not restored"):
        accel.load_state(tmp_path, model=untied, optimizer=untied_opt)
    assert torch.equal(untied.head.weight, tied.embed.weight)
    assert torch.equal(untied.embed.weight, tied.embed.weight)
    untied.head.weight = untied.embed.weight  # the tie, made after loading
    for a, b in zip(tied.state_dict().values(), untied.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_full_weights_of_a_tied_fsdp_model_hold_the_tie_once(saved: Any) -> None:
    family, root, uninterrupted = saved
    alias, first = _ALIASES[family]
    assert uninterrupted["shared"]
    index = json.loads((root / "weights" / "model.safetensors.index.json").read_text())
    assert first in index["weight_map"] and alias not in index["weight_map"]
    model = tm.MODELS[family](seed=5)
    accel.load_checkpoint_in_model(model, root / "weights")
    tied = dict(model.named_parameters(remove_duplicate=False))
    assert tied[alias] is tied[first]


class _Adapter:
    """A part of a model's weights, as a LoRA adapter's save hook would give (peft style)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.model.state_dict().items() if k.startswith("blocks.0.")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state, strict=False)


def _adapter_body(root: str, save: bool) -> dict[str, torch.Tensor]:
    model, optimizer = _prepared("toy", "fsdp", seed=0 if save else 5)
    if save:
        _step(model, optimizer, 0)
        accel.save_state(root, adapter=_Adapter(model))
    else:
        accel.load_state(root, adapter=_Adapter(model))
    return {k: v for k, v in accel.get_state_dict(model).items() if k.startswith("blocks.0.")}


def test_another_object_holding_fsdp_shards_saves_and_reshards(tmp_path: pathlib.Path) -> None:
    saved = run_distributed(_adapter_body, str(tmp_path), True, world_size=2, timeout=120)[0]
    for loaded in run_distributed(_adapter_body, str(tmp_path), False, world_size=3, timeout=120):
        _close(loaded, saved)
    plain = tm.toy(seed=5)
    with pytest.warns(UserWarning, match="RNG states are not restored"):
        accel.load_state(tmp_path, adapter=_Adapter(plain))
    _close({k: v for k, v in plain.state_dict().items() if k in saved}, saved)

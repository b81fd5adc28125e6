"""save_state / load_state / save_model on 2 and 3 real processes with DDP models."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_distributed


def _setup(seed: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = accel.prepare_model(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)))
    opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    return model, opt


def _step(model: nn.Module, opt: Any) -> None:
    rank = accel.state().rank
    x = torch.linspace(-1, 1, 24).reshape(4, 6) + rank
    accel.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()


def _save_then_load(root: str) -> dict[str, Any]:
    st = accel.state()
    model, opt = _setup(0)
    _step(model, opt)
    random.seed(100 + st.rank)  # per-rank RNG streams must come back per rank
    torch.manual_seed(200 + st.rank)
    path = accel.save_state(root, step=5, model=model, optimizer=opt)
    expected = (random.random(), torch.rand(2).tolist())
    weights = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    opt_state = opt.state_dict()
    model2, opt2 = _setup(1)
    info = accel.load_state(root, model=model2, optimizer=opt2)
    assert info is not None
    got = (random.random(), torch.rand(2).tolist())
    same_weights = all(torch.equal(v, accel.get_state_dict(model2)[k]) for k, v in weights.items())
    same_opt = all(
        torch.equal(v, opt2.state_dict()["state"][i][name])
        for i, group in opt_state["state"].items()
        for name, v in group.items()
    )
    _step(model, opt)
    _step(model2, opt2)  # both continue alike (3-rank sums may round differently per bucket)
    after = [
        torch.allclose(a, b, atol=1e-6)
        for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    ]
    accel.save_model(model, Path(root) / "export")
    return {
        "path": str(path), "step": info.step, "world": info.world_size, "rng_ok": got == expected,
        "weights_ok": same_weights, "opt_ok": same_opt, "after_ok": all(after),
        "files": sorted(p.name for p in path.iterdir()),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_state_round_trip_across_ranks(world_size: int, tmp_path: Path) -> None:
    results = run_distributed(_save_then_load, str(tmp_path), world_size=world_size)
    for out in results:
        assert out["step"] == 5 and out["world"] == world_size
        assert out["rng_ok"] and out["weights_ok"] and out["opt_ok"] and out["after_ok"]
    files = results[0]["files"]
    assert [f"rng_rank{r}.safetensors" in files for r in range(world_size)] == [True] * world_size
    assert "model.safetensors" in files and "optimizer.safetensors" in files
    # the DDP-prepared model's checkpoint loads into a bare module (no "module." prefix)
    bare = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    accel.load_checkpoint_in_model(bare, tmp_path / "export", strict=True)
    with accel.distributed(), pytest.warns(UserWarning, match="RNG states are not restored"):
        info = accel.load_state(tmp_path, model=bare)  # another world size: weights still load
    assert info is not None and info.world_size == world_size


def _gated_save(root: str) -> str:
    model, _ = _setup(0)

    @accel.on_main_process
    def save() -> None:
        accel.save_state(root, model=model)

    try:
        save()
    except accel.errors.GatedCollectiveError as exc:
        return str(exc)
    return "no error"


def test_save_state_inside_a_gate_raises_instead_of_deadlocking(tmp_path: Path) -> None:
    results = run_distributed(_gated_save, str(tmp_path), world_size=2, timeout=60)
    assert "accel.save_state()" in results[0] and "on_main_process" in results[0]
    assert results[1] == "no error"

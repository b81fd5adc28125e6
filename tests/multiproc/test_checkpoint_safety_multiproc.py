"""A save or load failing on any rank fails on every rank at once, never by a timeout; ranks
fall back together past a checkpoint that fails on one of them."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
import accel.checkpoint.state as state_module
from accel.errors import CheckpointError
from accel.testing import run_distributed


class _RaisesOnSave:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(f"state_dict failed on rank {accel.state().rank}")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def _model(value: float, width: int = 4) -> nn.Module:
    model = nn.Linear(width, width)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _attempt(fn: Any) -> str:
    start = time.monotonic()
    try:
        fn()
    except CheckpointError as exc:
        return f"CheckpointError after {time.monotonic() - start:.1f}s: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _every_failure_reaches_every_rank(root: str) -> dict[str, Any]:
    rank = accel.state().rank
    base = Path(root)
    out: dict[str, Any] = {}
    # a user object's state_dict() raises on rank 0 (the only rank that calls it)
    out["object"] = _attempt(
        lambda: accel.save_state(base / "a", step=1, model=_model(1.0), bad=_RaisesOnSave())
    )
    # a failure only rank 1 meets (its RNG capture)
    real = state_module.get_rng_state

    def broken() -> dict[str, Any]:
        raise OSError("disk full on rank 1")

    if rank == 1:
        state_module.get_rng_state = broken
    try:
        out["rank1_write"] = _attempt(lambda: accel.save_state(base / "b", model=_model(1.0)))
    finally:
        state_module.get_rng_state = real
    # a directory holding the user's files is refused on every rank
    if rank == 0:
        (base / "user").mkdir()
        (base / "user" / "train_log.txt").write_text("keep me")
    accel.wait_for_everyone()
    out["foreign"] = _attempt(lambda: accel.save_state(base / "user", model=_model(1.0)))
    # a load that only rank 1 cannot apply (another shape) changes nothing on any rank
    accel.save_state(base / "c", model=_model(1.0))
    target = _model(5.0, width=4 if rank == 0 else 3)
    out["shape"] = _attempt(lambda: accel.load_state(base / "c", model=target))
    out["untouched"] = bool(torch.all(target.weight == 5.0))
    out["leftovers"] = sorted(p.name for p in base.iterdir() if p.name.startswith("."))
    return out


def test_save_and_load_failures_reach_every_rank_at_once(tmp_path: Path) -> None:
    results = run_distributed(_every_failure_reaches_every_rank, str(tmp_path), world_size=2,
                              timeout=60)
    for rank, out in enumerate(results):
        assert out["object"].startswith("CheckpointError"), (rank, out["object"])
        assert "state_dict failed on rank 0" in out["object"]
        assert out["rank1_write"].startswith("CheckpointError"), (rank, out["rank1_write"])
        assert "rank 1" in out["rank1_write"] and "disk full" in out["rank1_write"]
        assert out["foreign"].startswith("CheckpointError") and "train_log.txt" in out["foreign"]
        assert out["shape"].startswith("CheckpointError") and "rank 1" in out["shape"]
        assert out["untouched"], f"rank {rank} changed its model although the load failed"
        for key in ("object", "rank1_write", "foreign", "shape"):
            seconds = float(out[key].split(" after ")[1].split("s:")[0])
            assert seconds < 10, f"{key} on rank {rank} waited {seconds}s for a timeout"
    assert (tmp_path / "user" / "train_log.txt").read_text() == "keep me"
    assert not [n for n in results[0]["leftovers"] if ".tmp-" in n]
    assert not (tmp_path / "a" / "checkpoint_1").exists()


def _fall_back_together(root: str) -> dict[str, Any]:
    rank = accel.state().rank
    for step in (1, 2):
        accel.save_state(root, step=step, model=_model(float(step)))
    if rank == 0:  # damage a file only rank 1 reads
        victim = Path(root) / "checkpoint_2" / "rng_rank1.json"
        data = bytearray(victim.read_bytes())
        data[0] ^= 0xFF
        victim.write_bytes(bytes(data))
    accel.wait_for_everyone()
    target = _model(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = accel.load_state(root, model=target)
    explicit = _attempt(lambda: accel.load_state(Path(root) / "checkpoint_2", model=target))
    return {
        "step": info.step if info else None,
        "weight": float(target.weight[0, 0]),
        "warned": [str(w.message) for w in caught],
        "explicit": explicit,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_fall_back_together_past_a_checkpoint_one_rank_cannot_read(
    tmp_path: Path, world_size: int
) -> None:
    results = run_distributed(_fall_back_together, str(tmp_path), world_size=world_size,
                              timeout=60)
    assert [r["step"] for r in results] == [1] * world_size
    assert [r["weight"] for r in results] == [1.0] * world_size
    assert any("checkpoint_2" in w and "rng_rank1.json" in w for w in results[0]["warned"])
    for r in results:
        assert r["explicit"].startswith("CheckpointError") and "rank 1" in r["explicit"]

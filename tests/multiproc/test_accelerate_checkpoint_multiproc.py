"""load_state of a checkpoint written by Accelerate's save_state, on 2 real processes.

Every rank reads the same directory into its DDP-prepared objects; a failure on one rank is
raised on every rank.
"""

from __future__ import annotations

import builtins
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import accel
from accel.errors import CheckpointError
from accel.testing import run_distributed


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (self.marker, "w"))


def _build(width: int = 6) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _write(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Accelerate's layout as 2 DDP processes write it ('module.' keys, 2 RNG pickles)."""
    torch.manual_seed(0)
    model, opt = _build()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path.mkdir()
    save_file({f"module.{k}": v for k, v in model.state_dict().items()},
              path / "model.safetensors", metadata={"format": "pt"})
    torch.save(opt.state_dict(), path / "optimizer.bin")
    for rank in range(2):
        (path / f"random_states_{rank}.pkl").write_bytes(
            pickle.dumps(_Exploit(os.fspath(path.parent / "pwned")))
        )
    return model, opt


def _load(directory: str) -> dict[str, Any]:
    rank = accel.state().rank
    torch.manual_seed(10 + rank)
    model, opt = _build()
    model = accel.prepare_model(model)
    opt = accel.prepare_optimizer(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = accel.load_state(directory, model=model, optimizer=opt)
    inner = accel.unwrap_model(model)
    # then a load that fails on rank 1 only (a model of other shapes there)
    other, _ = _build(9 if rank == 1 else 6)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    try:
        accel.load_state(directory, model=other)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {
        "weights": {k: v.clone() for k, v in inner.state_dict().items()},
        "opt": opt.state_dict()["state"],
        "world_size": info.world_size if info is not None else None,
        "refused": getattr(info, "files_refused", None),
        "warnings": [str(w.message) for w in caught],
        "error": error,
        "unchanged": all(torch.equal(v, other.state_dict()[k]) for k, v in before.items()),
    }


def test_two_ranks_load_the_same_accelerate_checkpoint(tmp_path: Path) -> None:
    model, opt = _write(tmp_path / "acc")
    results = run_distributed(_load, os.fspath(tmp_path / "acc"), world_size=2)
    expected = model.state_dict()
    for result in results:
        assert result["weights"].keys() == expected.keys()
        assert all(torch.equal(result["weights"][k], expected[k]) for k in expected)
        saved = opt.state_dict()["state"]
        assert all(
            torch.equal(result["opt"][i][key], saved[i][key])
            for i in saved for key in ("exp_avg", "exp_avg_sq")
        )
        assert result["world_size"] == 2
        assert result["refused"] == ("random_states_0.pkl", "random_states_1.pkl")
        assert any("RNG states were not restored" in w for w in result["warnings"])
        # a failure on one rank is raised on every rank, and nothing changed
        assert result["error"] is not None and "rank 1:" in result["error"]
        assert "other shapes" in result["error"] and "rank 0:" not in result["error"]
        assert result["unchanged"]
    assert not (tmp_path / "pwned").exists()

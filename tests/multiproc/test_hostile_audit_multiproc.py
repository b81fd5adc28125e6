"""Hostile checkpoints on 2 ranks: overlapping FSDP pieces and a root full of failing ones.

* Pieces of an FSDP checkpoint that claim the same rows twice (and so leave others out, which
  would load uninitialised memory into a plain model) are refused by every rank together, and
  no object changes.
* A root holding many ``checkpoint_N`` directories that cannot load (empty, or broken
  manifests): ``load_state`` finds them with one collective (not one per directory: 20,000 of
  them would take about a minute on 2 ranks) and loads the newest good one, with a warning
  that names the first few skipped and counts the rest.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

import accel
from accel.checkpoint import _screening, state
from accel.errors import CheckpointError
from accel.testing import run_distributed


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _save_sharded(path: str) -> None:
    model = accel.prepare_model(_net(), strategy="fsdp")
    accel.save_state(path, model=model)


def _redeclare(ckpt: Path, name: str, data: bytes) -> None:
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _load_plain(path: str) -> tuple[str, bool]:
    model = _net()
    for p in model.parameters():
        p.data.fill_(7.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accel.load_state(path, model=model)
        outcome = "loaded"
    except CheckpointError as exc:
        outcome = f"CheckpointError: {exc}"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, all(bool((p == 7.0).all()) for p in model.parameters())


def test_overlapping_pieces_are_refused_on_every_rank(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_distributed(_save_sharded, os.fspath(ckpt), world_size=2)
    body = json.loads((ckpt / "model__shards_rank1.json").read_bytes())
    body["extra"]["pieces"]["0.weight"]["offset"] = [0, 0]  # rank 0's rows, again
    _redeclare(ckpt, "model__shards_rank1.json", json.dumps(body).encode())
    for outcome, unchanged in run_distributed(_load_plain, os.fspath(ckpt), world_size=2):
        assert outcome.startswith("CheckpointError") and "overlap" in outcome, outcome
        assert unchanged


def _load_counting(root: str) -> tuple[str, int, list[str]]:
    """Load from ``root``, counting this rank's collectives in load_state (and screening)."""
    calls = 0
    originals = (state.gather_object, _screening.gather_object)

    def counted(value: Any) -> Any:
        nonlocal calls
        calls += 1
        return originals[0](value)

    state.gather_object = counted  # type: ignore[assignment]
    _screening.gather_object = counted  # type: ignore[assignment]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = accel.load_state(root, model=nn.Linear(4, 4))
    finally:
        state.gather_object, _screening.gather_object = originals  # type: ignore[assignment]
    assert info is not None
    return os.fspath(info.path), calls, [str(w.message) for w in caught]


def test_a_root_of_failing_checkpoints_costs_one_collective(tmp_path: Path) -> None:
    root = tmp_path / "root"
    good = accel.save_state(root, step=1, model=nn.Linear(4, 4))
    broken = accel.save_state(root, step=2, model=nn.Linear(4, 4))
    (broken / "manifest.json").write_text("{not json")
    for step in range(3, 503):
        (root / f"checkpoint_{step}").mkdir()
    for path, calls, caught in run_distributed(_load_counting, os.fspath(root), world_size=2):
        assert path == os.fspath(good)
        assert calls <= 4, calls  # candidates, screening, one verification, the restore
        skipped = [m for m in caught if "skipped checkpoints that failed verification" in m]
        assert len(skipped) == 1 and "and 491 more" in skipped[0], skipped
        assert "checkpoint_502" in skipped[0]

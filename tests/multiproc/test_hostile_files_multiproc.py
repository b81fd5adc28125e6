"""Hostile checkpoint files on 2 ranks.

A FIFO, a link to ``/dev/zero`` or to a file outside, a deep manifest or a header with absurd
dimensions is refused with a ``CheckpointError`` on every rank together (the ranks agree after
verification, whichever of them met the bad file), and ``load_state(root)`` falls back past it
on every rank. A bad old checkpoint never blocks ``save_state`` with ``total_limit`` (rotation
runs on rank 0 only: it warns and keeps it). A planted lock link fails the save on every rank
and is not written through. Each run is bounded in time (``run_distributed``'s timeout) and
each rank in address space (``RLIMIT_AS``), so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

import accel
from accel.errors import CheckpointError
from accel.testing import run_distributed

_SPARE = 3 << 30  # address space each rank may take beyond what it holds at the start


def _bound_memory() -> None:
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + _SPARE
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _model(value: float) -> nn.Linear:
    model = nn.Linear(4, 4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _attempt(fn: Any) -> str:
    try:
        fn()
    except CheckpointError as exc:
        return f"CheckpointError: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _declare(ckpt: Path, name: str, data: bytes) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    for entry in manifest["files"]:
        if entry["name"] == name:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _plant(kind: str, ckpt: Path) -> None:
    """Make one entry of the checkpoint ``ckpt`` hostile (rank 0 only)."""
    if kind == "fifo":
        _declare(ckpt, "model.json", b"")
        (ckpt / "model.json").unlink()
        os.mkfifo(ckpt / "model.json")
    elif kind == "dev_zero":
        _declare(ckpt, "model.safetensors", b"")
        (ckpt / "model.safetensors").unlink()
        (ckpt / "model.safetensors").symlink_to("/dev/zero")
    elif kind == "manifest_zero":
        (ckpt / "manifest.json").unlink()
        (ckpt / "manifest.json").symlink_to("/dev/zero")
    elif kind == "link_rank1":  # a file only rank 1 reads, linked to its own bytes outside
        outside = ckpt.parent.parent / "outside-rng_rank1.json"
        (ckpt / "rng_rank1.json").rename(outside)
        (ckpt / "rng_rank1.json").symlink_to(outside)
    elif kind == "deep_manifest":
        (ckpt / "manifest.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    elif kind == "absurd_dims":
        header = b'{"weight": {"dtype": "F32", "shape": [0, 1000000000000000000000000000000], '
        header += b'"data_offsets": [0, 0]}}'
        header += b" " * (-len(header) % 8)
        data = struct.pack("<Q", len(header)) + header
        (ckpt / "model.safetensors").write_bytes(data)
        _declare(ckpt, "model.safetensors", data)


KINDS = ("fifo", "dev_zero", "manifest_zero", "link_rank1", "deep_manifest", "absurd_dims")


def _hostile_entries(root: str) -> dict[str, Any]:
    _bound_memory()
    rank = accel.state().rank
    out: dict[str, Any] = {}
    for kind in KINDS:
        place = Path(root) / kind
        accel.save_state(place, step=1, model=_model(1.0))
        newest = accel.save_state(place, step=2, model=_model(2.0))
        if rank == 0:
            _plant(kind, newest)
        accel.wait_for_everyone()
        target = _model(0.0)
        out[f"{kind} explicit"] = _attempt(
            lambda newest=newest, target=target: accel.load_state(newest, model=target))
        out[f"{kind} untouched"] = bool(torch.all(target.weight.detach() == 0.0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info = accel.load_state(place, model=target)  # falls back past it, together
        out[f"{kind} fallback"] = (info.step if info else None,
                                   float(target.weight.detach()[0, 0]),
                                   [str(w.message) for w in caught])
    return out


def test_hostile_entries_fail_on_every_rank_and_both_fall_back(tmp_path: Path) -> None:
    results = run_distributed(_hostile_entries, str(tmp_path), world_size=2, timeout=240)
    why = {
        "fifo": "FIFO",
        "dev_zero": "symbolic link",
        "manifest_zero": "symbolic link",
        "link_rank1": "symbolic link",
        "deep_manifest": "nest more than",
        "absurd_dims": "too large for any tensor",
    }
    for rank, out in enumerate(results):
        for kind in KINDS:
            explicit = out[f"{kind} explicit"]
            assert explicit.startswith("CheckpointError") and why[kind] in explicit, (
                rank, kind, explicit)
            assert out[f"{kind} untouched"], (rank, kind)
            step, weight, warned = out[f"{kind} fallback"]
            assert (step, weight) == (1, 1.0), (rank, kind, out[f"{kind} fallback"])
            assert any("checkpoint_2" in w and why[kind] in w for w in warned), (rank, kind)
        assert "rank 1" in out["link_rank1 explicit"]  # only rank 1 met it; both raised
    assert (tmp_path / "fifo" / "checkpoint_2" / "model.json").is_fifo()  # nothing deleted


def _saves_past_a_bad_old_checkpoint(root: str) -> dict[str, Any]:
    _bound_memory()
    rank = accel.state().rank
    base = Path(root)
    accel.save_state(base, step=1, model=_model(1.0))
    if rank == 0:
        deep = b'{"files": ' * 50_000 + b"[]" + b"}" * 50_000  # valid JSON, too deep
        (base / "checkpoint_1" / "manifest.json").write_bytes(deep)
    accel.wait_for_everyone()
    out: dict[str, Any] = {"saves": [], "warned": []}
    for step in (2, 3, 4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["saves"].append(_attempt(
                lambda step=step: accel.save_state(base, step=step, total_limit=1,
                                                   model=_model(float(step)))))
        out["warned"] += [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = accel.latest_checkpoint(base)
    out["latest"] = None if latest is None else latest.name
    out["latest_warned"] = [str(w.message) for w in caught]
    return out


def test_a_bad_old_checkpoint_never_blocks_rotating_saves(tmp_path: Path) -> None:
    results = run_distributed(_saves_past_a_bad_old_checkpoint, str(tmp_path), world_size=2,
                              timeout=240)
    for rank, out in enumerate(results):
        assert out["saves"] == ["ok", "ok", "ok"], (rank, out["saves"])
        assert out["latest"] == "checkpoint_4", (rank, out)
    assert any("keeps" in w and "checkpoint_1" in w for w in results[0]["warned"])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_1", "checkpoint_4"]


def _planted_lock_link(root: str, victim: str) -> str:
    _bound_memory()
    base = Path(root)
    if accel.state().rank == 0:
        base.mkdir()
        (base / ".accel-checkpoints.lock").symlink_to(victim)
    accel.wait_for_everyone()
    return _attempt(lambda: accel.save_state(base, step=1, model=_model(1.0)))


def test_a_planted_lock_link_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's work\n")
    results = run_distributed(_planted_lock_link, str(tmp_path / "ckpt"), str(victim),
                              world_size=2, timeout=120)
    for rank, outcome in enumerate(results):
        assert outcome.startswith("CheckpointError") and "symbolic link" in outcome, (
            rank, outcome)
    assert victim.read_text() == "the user's work\n"
    assert not (tmp_path / "ckpt" / "checkpoint_1").exists()

"""Ranks that pass ``save_state`` / ``load_state`` different arguments are told, on every rank,
before anything is written or loaded.

Each check runs inside one process group and goes on to the next only after every rank
returned, so a later check also shows that the ranks' collectives stayed in step.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

import accel
from accel.core.state import set_state
from accel.errors import CheckpointError
from accel.testing import run_distributed


def _model(value: float = 1.0) -> nn.Module:
    model = nn.Linear(3, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _attempt(fn: Callable[[], Any]) -> str:
    start = time.monotonic()
    try:
        fn()
    except CheckpointError as exc:
        return f"CheckpointError after {time.monotonic() - start:.1f}s: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _entries(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _disagreeing_saves(root_name: str) -> dict[str, Any]:
    rank = accel.state().rank
    root = Path(root_name)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {}
    out["step"] = _attempt(lambda: accel.save_state(root / "s", step=5 + rank, model=model))
    extra = {"optimizer": opt} if rank == 1 else {}
    out["extra_optimizer"] = _attempt(
        lambda: accel.save_state(root / "o", step=1, model=model, **extra)
    )
    out["total_limit"] = _attempt(
        lambda: accel.save_state(root / "t", step=1, total_limit=2 + rank, model=model)
    )
    out["directory"] = _attempt(lambda: accel.save_state(root / f"d{rank}", model=model))
    out["async"] = _attempt(
        lambda: accel.save_state(root / "a", step=1, async_save=rank == 0, model=model)
    )
    # an argument valid on rank 0 only: rank 1 must not raise alone while rank 0 waits
    out["invalid_on_one"] = _attempt(
        lambda: accel.save_state(root / "i", step=1, total_limit=3 if rank == 0 else 0,
                                 model=model)
    )
    out["no_objects_on_one"] = _attempt(
        lambda: accel.save_state(root / "n", **({"model": model} if rank == 0 else {}))
    )
    # the same arguments still save, and the ranks' collectives are still in step
    out["agreed"] = str(accel.save_state(root / "good", step=3, model=model, optimizer=opt))
    return out


def _check_timely(rank: int, key: str, text: str) -> None:
    assert text.startswith("CheckpointError after"), (rank, key, text)
    seconds = float(text.split(" after ")[1].split("s:")[0])
    assert seconds < 10, f"{key} on rank {rank} waited {seconds}s"


def test_save_state_refuses_disagreeing_arguments_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_disagreeing_saves, str(tmp_path), world_size=2, timeout=90)
    for rank, out in enumerate(results):
        for key in ("step", "extra_optimizer", "total_limit", "directory", "async",
                    "invalid_on_one", "no_objects_on_one"):
            _check_timely(rank, key, out[key])
            assert "rank 0" in out[key] and "rank 1" in out[key], (key, out[key])
        assert "step" in out["step"] and "5" in out["step"] and "6" in out["step"]
        assert "optimizer" in out["extra_optimizer"]
        assert "total_limit" in out["total_limit"] and "2" in out["total_limit"]
        assert str(tmp_path / "d0") in out["directory"]
        assert str(tmp_path / "d1") in out["directory"]
        assert "async_save" in out["async"]
        assert out["agreed"] == str(tmp_path / "good" / "checkpoint_3")
    # nothing of a checkpoint was written for any refused call (at most the writer's lock)
    for name in ("s", "o", "t", "d0", "d1", "a", "i", "n"):
        assert not [e for e in _entries(tmp_path / name) if "checkpoint" in e.lstrip(".")
                    and not e.endswith(".lock")], (name, _entries(tmp_path / name))
        assert not (tmp_path / name / "manifest.json").exists()
    assert (tmp_path / "good" / "checkpoint_3" / "optimizer.json").exists()


def _disagreeing_loads(root_name: str) -> dict[str, Any]:
    rank = accel.state().rank
    root = Path(root_name)
    model, other = _model(1.0), _model(2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        accel.save_state(root / "r", step=step, model=model, optimizer=opt)
    accel.save_state(root / "r2", step=7, model=model, optimizer=opt)
    target = _model(9.0)
    out: dict[str, Any] = {}
    extra = {"optimizer": torch.optim.SGD(target.parameters(), lr=0.5)} if rank == 1 else {}
    out["objects"] = _attempt(lambda: accel.load_state(root / "r", model=target, **extra))
    out["directory"] = _attempt(
        lambda: accel.load_state(root / ("r" if rank == 0 else "r2"), model=target)
    )
    out["missing_ok"] = _attempt(
        lambda: accel.load_state(root / "none", missing_ok=rank == 1, model=target)
    )
    out["untouched"] = bool(torch.all(target.weight == 9.0))
    del other
    info = accel.load_state(root / "r", model=target)
    out["agreed"] = info.step if info is not None else None
    return out


def test_load_state_refuses_disagreeing_arguments_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_disagreeing_loads, str(tmp_path), world_size=2, timeout=90)
    for rank, out in enumerate(results):
        for key in ("objects", "directory", "missing_ok"):
            _check_timely(rank, key, out[key])
            assert "rank 0" in out[key] and "rank 1" in out[key], (key, out[key])
        assert "optimizer" in out["objects"]
        assert "missing_ok" in out["missing_ok"]
        assert out["untouched"], f"rank {rank} changed its model although the load was refused"
        assert out["agreed"] == 2


@contextmanager
def _two_machines() -> Iterator[accel.ProcessState]:
    """Ranks 0 and 1 on machine 0, rank 2 on machine 1 (faked, as in test_on_each_node)."""
    st = accel.state()
    node, local = [(0, 0), (0, 1), (1, 0)][st.rank]
    faked = attrs.evolve(st, node_rank=node, local_rank=local, local_world_size=2 - node,
                         num_nodes=2)
    with set_state(faked) as current:
        yield current


def _three_ranks(root_name: str) -> dict[str, Any]:
    rank = accel.state().rank
    root = Path(root_name)
    model = _model()
    out: dict[str, Any] = {}
    with _two_machines() as st:  # on_each_node: each machine may name its own disk ...
        here = root / f"machine{st.node_rank}"
        out["each_agreed"] = str(accel.save_state(here, step=2, on_each_node=True, model=model))
        # ... but the ranks of one machine share its copy: rank 1 names another directory
        there = here / "other" if rank == 1 else here
        out["each_mismatch"] = _attempt(
            lambda: accel.save_state(there, step=3, on_each_node=True, model=model)
        )
    # ranks 0 and 1 agree, rank 2 does not: the message groups the ranks by value
    out["step"] = _attempt(
        lambda: accel.save_state(root / "s", step=4 if rank < 2 else 8, model=model)
    )
    # only rank 1 (not the writer) passes another object
    extra = {"counter": torch.optim.SGD(model.parameters(), lr=1.0)} if rank == 1 else {}
    out["objects"] = _attempt(lambda: accel.save_state(root / "o", step=1, model=model, **extra))
    out["agreed"] = str(accel.save_state(root / "good", step=1, model=model))
    return out


def test_three_ranks_name_the_rank_that_differs(tmp_path: Path) -> None:
    results = run_distributed(_three_ranks, str(tmp_path), world_size=3, timeout=90)
    for rank, out in enumerate(results):
        _check_timely(rank, "step", out["step"])
        assert "4 on ranks [0, 1]" in out["step"] and "8 on rank 2" in out["step"], out["step"]
        _check_timely(rank, "objects", out["objects"])
        assert "counter" in out["objects"] and "rank 1" in out["objects"]
        assert out["agreed"] == str(tmp_path / "good" / "checkpoint_1")
        node = 0 if rank < 2 else 1
        assert out["each_agreed"] == str(tmp_path / f"machine{node}" / "checkpoint_2")
        _check_timely(rank, "each_mismatch", out["each_mismatch"])
        assert "node_rank=0" in out["each_mismatch"], out["each_mismatch"]
        assert "node_rank=1" not in out["each_mismatch"], out["each_mismatch"]
    assert not (tmp_path / "machine0" / "checkpoint_3").exists()
    assert not (tmp_path / "machine1" / "checkpoint_3").exists()
    assert not (tmp_path / "s" / "checkpoint_4").exists()
    assert not (tmp_path / "s" / "checkpoint_8").exists()


def _debug_block(root_name: str) -> str:
    rank = accel.state().rank
    return _attempt(lambda: accel.save_state(Path(root_name), step=rank, model=_model()))


def test_debug_mode_also_names_the_disagreement(tmp_path: Path) -> None:
    results = run_distributed(_debug_block, str(tmp_path), world_size=2, timeout=60, debug=True)
    for rank, text in enumerate(results):
        _check_timely(rank, "step", text)
        assert "step" in text and "rank 0" in text and "rank 1" in text


def _reseal(ck: Path, filename: str) -> None:
    manifest = json.loads((ck / "manifest.json").read_text())
    data = (ck / filename).read_bytes()
    for entry in manifest["files"]:
        if entry["name"] == filename:
            entry["size"], entry["crc32"] = len(data), zlib.crc32(data)
    (ck / "manifest.json").write_text(json.dumps(manifest))


def _edit(ck: Path, name: str, edit: Callable[[Any], None]) -> None:
    body = json.loads((ck / f"{name}.json").read_text())
    edit(body["state"])
    (ck / f"{name}.json").write_text(json.dumps(body))
    _reseal(ck, f"{name}.json")


def _bad_values(root_name: str) -> dict[str, Any]:
    rank = accel.state().rank
    root = Path(root_name)
    model = _model(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lr_ck = accel.save_state(root / "lr", model=model, optimizer=opt)
    rng_ck = accel.save_state(root / "rng", model=model, optimizer=opt)
    if rank == 0:
        _edit(lr_ck, "optimizer", lambda s: s["param_groups"][0].__setitem__("lr", "abc"))
        # a file only rank 1 restores from
        _edit(rng_ck, "rng_rank1", lambda s: s["python"].__setitem__("version", 99))
    accel.wait_for_everyone()
    target = _model(9.0)
    target_opt = torch.optim.SGD(target.parameters(), lr=0.5)
    out = {
        "lr": _attempt(lambda: accel.load_state(lr_ck, model=target, optimizer=target_opt)),
        "rng": _attempt(lambda: accel.load_state(rng_ck, model=target, optimizer=target_opt)),
    }
    out["untouched"] = bool(torch.all(target.weight == 9.0)) and (
        target_opt.param_groups[0]["lr"] == 0.5)
    return out


def test_refused_values_fail_on_every_rank_and_change_nothing(tmp_path: Path) -> None:
    results = run_distributed(_bad_values, str(tmp_path), world_size=2, timeout=60)
    for rank, out in enumerate(results):
        _check_timely(rank, "lr", out["lr"])
        assert "['lr']" in out["lr"] and "abc" in out["lr"], out["lr"]
        _check_timely(rank, "rng", out["rng"])
        assert "rank 1" in out["rng"] and "['version']" in out["rng"], out["rng"]
        assert out["untouched"], f"rank {rank} changed an object although the load failed"

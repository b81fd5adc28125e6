"""A save_model killed at any file operation leaves the old or the new weights, never a mix.

A forked child re-saves a sharded model over a directory that holds an earlier save of other
weights and the user's files. Its file operations (``fsync``, ``rename``, ``replace``,
``link``, ``symlink``, ``unlink``, ``rmdir``, ``mkdir`` and the directory swap) are counted
and the child exits abruptly (``os._exit``, as SIGKILL would) at the k-th one, for every k.
After each kill the directory must load strictly as exactly the old or the new weights, with
the user's files in place, and the next save must put everything back and leave no scratch
directory behind. A second test SIGKILLs a child that saves in a loop at random moments.
"""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel._files.atomic import leftovers
from accel.weights import _model_swap

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

_OPS = ("fsync", "rename", "replace", "link", "symlink", "unlink", "rmdir", "mkdir")
_SHARD = 1200  # bytes: the model below is written as 4 shards
_FILES = {"config.json": b'{"layers": 4}', "tokenizer.json": b'{"vocab": []}'}
_SUB = {"checkpoint_5/manifest.json": b'{"step": 5}', "checkpoint_5/model.safetensors": b"x"}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(12, 12) for _ in range(4)])


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _model(seed).state_dict().items()}


def _which(out: Path, candidates: dict[int, dict[str, torch.Tensor]]) -> int:
    """The seed whose weights ``out`` loads strictly; fails on a mix or a load error."""
    fresh = _model(99)
    accel.load_checkpoint_in_model(fresh, out, strict=True)
    loaded = fresh.state_dict()
    for seed, expected in candidates.items():
        if all(torch.equal(loaded[k], v) for k, v in expected.items()):
            return seed
    matches = {k: [s for s, e in candidates.items() if torch.equal(v, e[k])] for k, v in
               loaded.items()}
    raise AssertionError(f"{out} holds mixed weights: {matches}")


def _prepare(out: Path, old_shard: int | None) -> None:
    accel.save_model(_model(0), out, max_shard_size=old_shard or "10GB")
    for name, body in {**_FILES, **_SUB}.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_bytes(body)
    (out / "latest").symlink_to("checkpoint_5")


def _scratch(out: Path) -> list[Path]:
    return [p for kind in ("tmp", "old", "trash") for p in leftovers(out, kind)]


def _check_files(out: Path, *, subdir_anywhere: bool) -> None:
    for name, body in _FILES.items():
        assert (out / name).read_bytes() == body, name
    assert os.readlink(out / "latest") == "checkpoint_5"
    for name, body in _SUB.items():
        places = [out, *(_scratch(out) if subdir_anywhere else [])]
        found = [p / name for p in places if (p / name).exists()]
        assert len(found) == 1, (name, found)  # in exactly one place, never lost or doubled
        assert found[0].read_bytes() == body


def _counting(kill_at: int, counter: list[int]) -> None:
    """Patch the os functions so that call number ``kill_at`` ends the process first."""
    for name in _OPS:
        original: Callable[..., Any] = getattr(os, name)

        def counted(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            counter[0] += 1
            if counter[0] == kill_at:
                os._exit(9)
            return _original(*args, **kwargs)

        setattr(os, name, counted)
    swap: Callable[[Path, Path], bool] = _model_swap.exchange

    def counted_exchange(a: Path, b: Path) -> bool:
        counter[0] += 1
        if counter[0] == kill_at:
            os._exit(9)
        return swap(a, b)

    _model_swap.exchange = counted_exchange  # type: ignore[assignment]


def _child_save(out: Path, kill_at: int, can_exchange: bool) -> tuple[int, int]:
    """Fork a child that saves seed 1 and dies at operation ``kill_at``; (exit code, count)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            os.close(read)
            counter = [0]
            if not can_exchange:
                _model_swap.exchange = lambda a, b: False  # type: ignore[assignment]
            model = _model(1)
            _counting(kill_at, counter)
            accel.save_model(model, out, max_shard_size=_SHARD)
            os.write(write, str(counter[0]).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        count = pipe.read()
    return os.waitstatus_to_exitcode(status), int(count or 0)


@pytest.mark.slow
@pytest.mark.parametrize("can_exchange", [True, False], ids=["exchange", "rename-aside"])
@pytest.mark.parametrize("old_shard", [_SHARD, None], ids=["over-shards", "over-one-file"])
@pytest.mark.ci_extra
def test_killed_at_every_file_operation(
    tmp_path: Path, can_exchange: bool, old_shard: int | None
) -> None:
    candidates = {0: _weights(0), 1: _weights(1), 2: _weights(2)}
    out = tmp_path / "run0" / "export"
    _prepare(out, old_shard)
    code, total = _child_save(out, 0, can_exchange)
    assert code == 0 and total > 10
    assert _which(out, candidates) == 1 and not _scratch(out)
    seen = []
    for k in range(1, total + 1):
        out = tmp_path / f"run{k}" / "export"
        _prepare(out, old_shard)
        code, _ = _child_save(out, k, can_exchange)
        assert code == 9, f"the child was to die at operation {k} of {total}"
        seen.append(_which(out, candidates))  # loading alone works: old or new, never mixed
        _check_files(out, subdir_anywhere=True)
        accel.save_model(_model(2), out, max_shard_size=_SHARD)  # the next save repairs
        assert _which(out, candidates) == 2
        _check_files(out, subdir_anywhere=False)
        assert not _scratch(out), (k, _scratch(out))
    switch = seen.index(1)  # old until one instant, new from then on
    assert seen == [0] * switch + [1] * (total - switch), seen


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(20240613)
    candidates = {0: _weights(0), 1: _weights(1), 2: _weights(2)}
    out = tmp_path / "export"
    _prepare(out, _SHARD)
    seen = set()
    interrupted = 0
    for _ in range(25):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child saves alternating weights until killed
            try:
                models = [_model(1), _model(0)]
                for i in range(10**6):  # shards, and now and then one file
                    size = _SHARD if i % 3 else "10GB"
                    accel.save_model(models[i % 2], out, max_shard_size=size)
            finally:
                os._exit(3)
        time.sleep(rng.uniform(0.01, 0.15))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        seen.add(_which(out, candidates))
        _check_files(out, subdir_anywhere=True)
        interrupted += bool(_scratch(out))
    accel.save_model(_model(2), out)
    assert _which(out, candidates) == 2 and not _scratch(out)
    _check_files(out, subdir_anywhere=False)
    assert seen <= {0, 1}
    assert interrupted >= 5, "the kills should land in the middle of saves"

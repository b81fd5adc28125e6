"""Lock files never pile up beside a user's checkpoints, and still keep two writers apart.

Each save takes the writer lock of its place (``.NAME.accel-lock`` beside a fixed directory,
``ROOT/.accel-checkpoints.lock`` for numbered ones) and removes it when the save completes or
fails. A killed save cannot remove its own: the next save of that place reuses it and removes
it, and the previous checkpoint is still the one loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel._files import atomic as _atomic
from accel.checkpoint import _saving
from accel.checkpoint.layout import lock_path
from accel.errors import CheckpointError


def _model(value: float) -> nn.Linear:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


class _Broken:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("cannot save this")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_fixed_directory_saves_leave_only_the_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "output"
    model = _model(1.0)
    for step in range(1, 6):  # the no_trainer layout: output/step_N/, one fixed dir each
        accel.save_state(out / f"step_{step}", model=model)
    accel.save_state(out / "step_5", model=_model(5.0))  # replacing one too
    assert _names(out) == [f"step_{n}" for n in range(1, 6)]
    with pytest.raises(CheckpointError, match="cannot save this"):  # a failed save too
        accel.save_state(out / "step_6", model=model, other=_Broken())
    assert _names(out) == [f"step_{n}" for n in range(1, 6)]
    for step in (1, 2, 3):  # numbered checkpoints: the root holds only them
        accel.save_state(out / "numbered", step=step, total_limit=2, model=model)
    assert _names(out / "numbered") == ["checkpoint_2", "checkpoint_3"]
    restored = _model(0.0)
    accel.load_state(out / "step_5", model=restored)
    assert torch.equal(restored.weight, torch.full((2, 2), 5.0))


def test_a_held_lock_still_refuses_a_second_writer(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    accel.save_state(final, model=_model(1.0))
    lock = lock_path(final, False)
    with _atomic.writer_lock(lock, "the test"):
        assert lock.read_text().startswith(f"pid {os.getpid()} on ")  # held: it exists
        with pytest.raises(CheckpointError, match="Another writer"):
            accel.save_state(final, model=_model(2.0))
    assert not lock.exists()
    accel.save_state(final, model=_model(2.0))
    assert _names(tmp_path) == ["ckpt"]


def test_a_lock_file_removed_by_its_holder_is_not_held_by_a_late_opener(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a late opener opened the lock file just before its holder removed it; once the holder
    # is gone its flock succeeds on the removed file, which locks nothing: it must take the
    # file now at the path (and a third writer must then be refused)
    lock = tmp_path / ".ckpt.accel-lock"
    lock.write_text("")
    stale = os.open(lock, os.O_RDWR)
    lock.unlink()  # what the holder did before closing its descriptor
    real_open = _atomic.open_lock
    opened: list[int] = []

    def late_open(path: str | os.PathLike[str]) -> int:
        opened.append(1)
        return stale if len(opened) == 1 else real_open(path)

    monkeypatch.setattr(_atomic, "open_lock", late_open)
    with _atomic.writer_lock(lock, "the test"):
        assert len(opened) == 2 and lock.exists()
        monkeypatch.setattr(_atomic, "open_lock", real_open)
        with (
            pytest.raises(CheckpointError, match="Another writer"),
            _atomic.writer_lock(lock, "the test"),
        ):
            pass
        assert lock.exists()  # a refused writer removes nothing
    assert not lock.exists()


def test_a_save_killed_mid_way_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "ckpt"
    accel.save_state(final, model=_model(1.0))

    def killed(tmp: Path, target: Path) -> None:
        os._exit(9)  # the process dies with every file written, before the swap

    pid = os.fork()  # a bounded child: it only saves a 2x2 model, then dies
    if pid == 0:
        try:
            monkeypatch.setattr(_saving, "replace_dir", killed)
            accel.save_state(final, model=_model(2.0))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert ".ckpt.accel-lock" in _names(tmp_path)  # a killed save cannot remove its own
    restored = _model(0.0)
    accel.load_state(final, model=restored)
    assert torch.equal(restored.weight, torch.full((2, 2), 1.0))
    accel.save_state(final, model=_model(3.0))  # the next save repairs and removes it all
    assert _names(tmp_path) == ["ckpt"]
    accel.load_state(final, model=restored)
    assert torch.equal(restored.weight, torch.full((2, 2), 3.0))

"""save_state / load_state refuse a call naming no object (it would save only RNG states and
restore nothing), before touching the filesystem, with the call to write in the message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch import nn

import accel
from accel.errors import AccelError, CheckpointArgumentError, CheckpointError

CALL = (
    "accel.save_state(dir, model=model, optimizer=optimizer, scheduler=scheduler, "
    "train_loader=loader)"
)


@pytest.mark.parametrize(
    "options", [{}, {"step": 3}, {"step": 3, "total_limit": 2}, {"on_each_node": True}]
)
def test_save_state_without_objects_raises_and_writes_nothing(
    tmp_path: Path, options: dict[str, object]
) -> None:
    target = tmp_path / "ckpt"
    with accel.distributed(), pytest.raises(CheckpointArgumentError) as caught:
        accel.save_state(target, **options)  # type: ignore[arg-type]
    message = str(caught.value)
    assert CALL in message
    assert "only RNG states" in message and repr(os.fspath(target)) in message
    assert isinstance(caught.value, AccelError) and isinstance(caught.value, CheckpointError)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("missing_ok", [False, True])
def test_load_state_without_objects_raises(tmp_path: Path, missing_ok: bool) -> None:
    target = tmp_path / "ckpt"
    with accel.distributed():
        accel.save_state(target, model=nn.Linear(2, 2))
        before = sorted(p.name for p in target.iterdir())
        with pytest.raises(CheckpointArgumentError, match="restore nothing") as caught:
            accel.load_state(target, missing_ok=missing_ok)
        with pytest.raises(CheckpointArgumentError, match="restore nothing"):
            accel.load_state(tmp_path / "absent", missing_ok=missing_ok)
    assert "accel.load_state(dir, model=model, optimizer=optimizer" in str(caught.value)
    assert CALL in str(caught.value)
    assert sorted(p.name for p in target.iterdir()) == before
    assert not (tmp_path / "absent").exists()


def test_named_objects_still_save_and_load(tmp_path: Path) -> None:
    model, fresh = nn.Linear(2, 2), nn.Linear(2, 2)
    with accel.distributed():
        accel.save_state(tmp_path / "ckpt", model=model)
        info = accel.load_state(tmp_path / "ckpt", model=fresh)
    assert info is not None and info.objects == ("model",)
    assert all((a == b).all() for a, b in zip(model.parameters(), fresh.parameters(), strict=True))

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.errors import CheckpointError, GatedCollectiveError


class Counter:
    """A user object with the state_dict protocol."""

    def __init__(self) -> None:
        self.n = 0
        self.history: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history), "t": torch.tensor([self.n])}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.history = sd["n"], list(sd["history"])
        assert int(sd["t"]) == self.n


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
            "counter": Counter()}


def _train(objs: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        loss = objs["model"](torch.randn(5, 4)).pow(2).mean()
        loss.backward()
        objs["optimizer"].step()
        objs["scheduler"].step()
        objs["optimizer"].zero_grad()
        objs["counter"].n += 1
        objs["counter"].history.append(objs["counter"].n)
    objs["scaler"].scale(torch.tensor(1.0))  # makes the scale tensor
    objs["scaler"].update(512.0)


def test_round_trip_of_every_object_kind_and_rng(tmp_path: Path) -> None:
    objs = _objects(0)
    _train(objs, 3)
    path = accel.save_state(tmp_path / "ck", step=3, **objs)
    assert path == tmp_path / "ck" / "checkpoint_3"
    files = sorted(p.name for p in path.iterdir())
    assert not [f for f in files if f.endswith((".pkl", ".bin", ".pt", ".pth"))]
    assert "manifest.json" in files
    expected_next = (random.random(), torch.rand(3))
    restored = _objects(1)
    info = accel.load_state(tmp_path / "ck", **restored)
    assert info is not None
    assert (info.step, info.world_size, info.path) == (3, 1, path)
    assert set(info.objects) == {"model", "optimizer", "scheduler", "scaler", "counter"}
    assert (random.random(), torch.rand(3).tolist()) == (expected_next[0],
                                                         expected_next[1].tolist())
    for key, value in objs["model"].state_dict().items():
        assert torch.equal(restored["model"].state_dict()[key], value)
    assert restored["scheduler"].state_dict() == objs["scheduler"].state_dict()
    assert restored["scaler"].get_scale() == 512.0
    assert restored["counter"].history == [1, 2, 3]
    # continuing both gives the same weights
    torch.manual_seed(7)
    _train(objs, 2)
    torch.manual_seed(7)
    _train(restored, 2)
    for a, b in zip(objs["model"].parameters(), restored["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_total_limit_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    (tmp_path / ".checkpoint_99.tmp-deadbeef").mkdir()  # a killed save's leftovers
    for step in range(1, 6):
        accel.save_state(tmp_path, step=step, total_limit=2, model=model)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint_4", "checkpoint_5"]  # each save removed its lock
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_5"


def test_latest_checkpoint_ignores_incomplete_ones(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    accel.save_state(tmp_path, step=10, model=model)
    (tmp_path / "checkpoint_20").mkdir()  # no manifest: incomplete
    (tmp_path / ".checkpoint_30.tmp-abc").mkdir()
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_10"
    assert accel.latest_checkpoint(tmp_path / "checkpoint_10") == tmp_path / "checkpoint_10"
    assert accel.latest_checkpoint(tmp_path / "nothing") is None


def test_missing_checkpoints_and_objects(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    assert accel.load_state(tmp_path, missing_ok=True, model=model) is None
    with pytest.raises(CheckpointError, match="missing_ok=True"):
        accel.load_state(tmp_path, model=model)
    accel.save_state(tmp_path, step=1, model=model)
    with pytest.raises(CheckpointError, match=r"holds \['model'\], not \['optimizer'\]"):
        accel.load_state(tmp_path, optimizer=torch.optim.SGD(model.parameters(), lr=1))


def test_corrupted_and_truncated_files_raise_checkpoint_error(tmp_path: Path) -> None:
    model = nn.Linear(64, 64)
    path = accel.save_state(tmp_path, step=1, model=model)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*corrupted"):
        accel.load_state(tmp_path, model=model)
    weights.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        accel.load_state(tmp_path, model=model)
    weights.write_bytes(data)
    (path / "model.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"model\.json"):
        accel.load_state(tmp_path, model=model)


def test_bad_objects_and_gated_calls(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"model=.*state_dict"):
        accel.save_state(tmp_path, model=object())
    with pytest.raises(CheckpointError, match="'rng'"):
        accel.save_state(tmp_path, rng=nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match="total_limit"):
        accel.save_state(tmp_path, total_limit=2, model=nn.Linear(1, 1))

    @accel.on_main_process
    def save_on_main() -> None:
        accel.save_state(tmp_path, model=nn.Linear(1, 1))

    with pytest.raises(GatedCollectiveError, match="save_state"):
        save_on_main()


def test_state_that_needs_pickle_is_refused_with_its_path(tmp_path: Path) -> None:
    class Weird:
        def state_dict(self) -> dict[str, Any]:
            return {"cfg": {"fn": print}}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    with pytest.raises(CheckpointError, match=r"builtin_function_or_method at 'cfg\.fn'"):
        accel.save_state(tmp_path, weird=Weird())
    assert accel.latest_checkpoint(tmp_path) is None
    assert not any(tmp_path.iterdir())  # the temporary directory was cleaned up

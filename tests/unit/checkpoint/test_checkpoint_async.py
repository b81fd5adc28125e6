"""save_state(..., async_save=True) and wait_for_checkpoints() on one process."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.checkpoint import _async
from accel.errors import CheckpointArgumentError, CheckpointError, GatedCollectiveError


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "manifest.json"}


def _manifest(path: Path) -> dict[str, Any]:
    manifest = json.loads((path / "manifest.json").read_text())
    for per_save in ("created", "save_id"):
        assert manifest.pop(per_save)
    return manifest  # type: ignore[no-any-return]


def _fail_writes(monkeypatch: pytest.MonkeyPatch, message: str = "disk on fire") -> None:
    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError(5, message)

    monkeypatch.setattr(_async, "write_files", failing)


def test_async_save_equals_sync_save_byte_for_byte(tmp_path: Path) -> None:
    model, opt = _setup()
    with accel.distributed():
        torch.manual_seed(5)
        sync = accel.save_state(tmp_path / "sync", step=3, model=model, optimizer=opt)
        torch.manual_seed(5)  # the same RNG states are saved
        done = accel.save_state(tmp_path / "async", step=3, async_save=True, model=model,
                                optimizer=opt)
        accel.wait_for_checkpoints()
    assert done == tmp_path / "async" / "checkpoint_3"
    assert _files(done) == _files(sync)
    assert len(_files(done)) == 6
    assert _manifest(done) == _manifest(sync)


def test_changes_right_after_the_call_do_not_reach_the_checkpoint(tmp_path: Path) -> None:
    model, opt = _setup()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    with accel.distributed():
        accel.save_state(tmp_path, step=1, async_save=True, model=model, optimizer=opt)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)  # the background thread may not have written anything yet
        _train(model, opt)
        accel.wait_for_checkpoints()
        fresh, fresh_opt = _setup(seed=9)
        accel.load_state(tmp_path, model=fresh, optimizer=fresh_opt)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, saved[key]), key
    for key, value in fresh_opt.state_dict()["state"][0].items():
        assert torch.equal(value, saved_opt[key]), key


def test_the_checkpoint_is_visible_only_once_finished(tmp_path: Path) -> None:
    model, opt = _setup()
    with accel.distributed():
        accel.save_state(tmp_path, step=1, model=model, optimizer=opt)
        accel.save_state(tmp_path, step=2, async_save=True, model=model, optimizer=opt)
        assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_1"
        assert not (tmp_path / "checkpoint_2").exists()
        accel.wait_for_checkpoints()
        assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_2"
        accel.wait_for_checkpoints()  # nothing pending: returns at once
        accel.save_state(tmp_path, step=3, async_save=True, model=model, optimizer=opt)
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_3"  # block end waited
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "checkpoint_1", "checkpoint_2", "checkpoint_3"]


@pytest.mark.parametrize("next_call", ["wait", "save", "load", "block_end"])
def test_a_background_failure_is_raised_at_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, next_call: str
) -> None:
    model, opt = _setup()
    with accel.distributed():
        accel.save_state(tmp_path, step=1, model=model, optimizer=opt)
    _fail_writes(monkeypatch)
    with (  # noqa: PT012 - the failure surfaces at the call under test, or at the block end
        pytest.raises(CheckpointError, match="disk on fire") as caught,
        accel.distributed(),
    ):
        accel.save_state(tmp_path, step=2, async_save=True, model=model, optimizer=opt)
        if next_call == "wait":
            accel.wait_for_checkpoints()
        elif next_call == "save":
            accel.save_state(tmp_path, step=3, model=model, optimizer=opt)
        elif next_call == "load":
            accel.load_state(tmp_path, model=model, optimizer=opt)
        if next_call != "block_end":
            raise AssertionError("not reached: the failure must surface before")
    assert "previous checkpoint is intact" in str(caught.value)
    assert "OSError" in str(caught.value)
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_1"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    monkeypatch.undo()
    with accel.distributed():  # the lock was released: the next save works
        accel.save_state(tmp_path, step=3, async_save=True, model=model, optimizer=opt)
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_3"


def test_a_failure_is_raised_once_then_saves_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _setup()
    with accel.distributed():
        _fail_writes(monkeypatch)
        accel.save_state(tmp_path, step=1, async_save=True, model=model, optimizer=opt)
        monkeypatch.undo()
        with pytest.raises(CheckpointError, match="disk on fire"):
            accel.wait_for_checkpoints()
        accel.wait_for_checkpoints()  # reported once, not again
        accel.save_state(tmp_path, step=2, async_save=True, model=model, optimizer=opt)
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_2"
    assert not (tmp_path / "checkpoint_1").exists()


def test_rotation_with_async_saves(tmp_path: Path) -> None:
    model, opt = _setup()
    with accel.distributed():
        for step in range(5):
            with torch.no_grad():
                model[0].bias.fill_(float(step))
            accel.save_state(tmp_path, step=step, total_limit=2, async_save=True, model=model,
                             optimizer=opt)
            kept = sorted(p.name for p in tmp_path.glob("checkpoint_*"))
            assert kept == [f"checkpoint_{s}" for s in range(max(0, step - 2), step)]
    assert sorted(p.name for p in tmp_path.glob("checkpoint_*")) == [
        "checkpoint_3", "checkpoint_4"]
    fresh, fresh_opt = _setup(seed=3)
    with accel.distributed():
        info = accel.load_state(tmp_path, model=fresh, optimizer=fresh_opt)
    assert info is not None and info.step == 4
    assert torch.all(fresh[0].bias == 4.0)


def test_staging_buffers_are_reused_between_saves(tmp_path: Path) -> None:
    model, opt = _setup()
    with accel.distributed():
        accel.save_state(tmp_path, step=1, async_save=True, model=model)
        staging = _async._STAGING.get(_async.scope())
        first = {k: v.data_ptr() for k, v in staging.buffers.items()}
        accel.save_state(tmp_path, step=2, async_save=True, model=model)
        again = {k: v.data_ptr() for k, v in staging.buffers.items()}
        assert again == first and len(first) >= 2
        accel.save_state(tmp_path, step=3, async_save=True, model=model, optimizer=opt)
        assert len(staging.buffers) > len(first)  # new files get new buffers
        accel.save_state(tmp_path, step=4, async_save=True, model=nn.Linear(3, 3))
        names = {file for file, _ in staging.buffers}  # buffers no save used are dropped
        assert names == {"model.safetensors", "rng_rank0.safetensors"}
        assert staging.buffers["model.safetensors", 1].shape == (3, 3)


def test_async_save_needs_a_distributed_block_and_a_bool(tmp_path: Path) -> None:
    model, _ = _setup()
    with pytest.raises(CheckpointArgumentError, match="distributed"):
        accel.save_state(tmp_path, async_save=True, model=model)
    with accel.distributed(), pytest.raises(CheckpointArgumentError, match="'yes'"):
        accel.save_state(tmp_path, async_save="yes", model=model)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_snapshot_failure_raises_at_once_and_leaves_nothing(tmp_path: Path) -> None:
    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("cannot snapshot")

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    model, _ = _setup()
    with accel.distributed():
        accel.save_state(tmp_path, step=1, model=model)
        with pytest.raises(CheckpointError, match="cannot snapshot"):
            accel.save_state(tmp_path, step=2, async_save=True, model=model, other=Broken())
        accel.wait_for_checkpoints()  # nothing was left pending
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1"]  # no lock left


def test_an_exception_leaving_the_block_abandons_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _setup()
    started = threading.Event()
    release = threading.Event()
    real = _async.write_files

    def slow(*args: Any, **kwargs: Any) -> Any:
        started.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(_async, "write_files", slow)

    def run() -> None:
        with accel.distributed():
            accel.save_state(tmp_path, step=1, async_save=True, model=model, optimizer=opt)
            assert started.wait(10)
            release.set()
            raise KeyError("user code failed")

    with pytest.raises(KeyError):
        run()
    gc.collect()  # the block's scope is gone: its pending save is cancelled and tidied
    assert not [t for t in threading.enumerate() if t.name == "accel-checkpoint-writer"]
    assert accel.latest_checkpoint(tmp_path) is None
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    monkeypatch.undo()
    with accel.distributed():  # the writer lock was released
        accel.save_state(tmp_path, step=2, model=model, optimizer=opt)
    assert accel.latest_checkpoint(tmp_path) == tmp_path / "checkpoint_2"


def test_wait_for_checkpoints_inside_a_rank_gate_raises(tmp_path: Path) -> None:
    @accel.on_main_process
    def gated() -> None:
        accel.wait_for_checkpoints()

    with accel.distributed(), pytest.raises(GatedCollectiveError, match="wait_for_checkpoints"):
        gated()

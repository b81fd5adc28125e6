"""The ``aim`` tracker against the real package: a local repo, read back with ``aim.Repo``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from accel.testing import fake_state

pytestmark = [pytest.mark.ci_extra, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _loop(project: Path, run_name: str, fail: bool = False) -> Any:
    config = {"lr": 0.1, "layers": [2, 3], "path": Path("data")}
    with accel.tracking(project, log_with="aim", config=config, run_name=run_name):
        for step in range(3):
            loss = torch.tensor(1.0 / (step + 1))
            accel.log({"loss": loss, "eval": {"acc": step / 4}}, step=step)
        accel.log({"phase": "eval"}, step=3)
        run = accel.get_tracker("aim")
        if fail:
            raise RuntimeError("boom")
    return run


def _runs(project: Path) -> dict[str, Any]:
    aim = pytest.importorskip("aim")
    return {run.name: run for run in aim.Repo(str(project)).iter_runs()}


def test_aim_run_is_read_back_by_aim(tmp_path: Path, no_network: list[str]) -> None:
    aim = pytest.importorskip("aim", reason="extra accel[aim] not installed")
    from aim.storage.context import Context

    native = _loop(tmp_path / "proj", "r1")
    assert isinstance(native, aim.Run)
    runs = _runs(tmp_path / "proj")
    assert sorted(runs) == ["r1"]
    run = runs["r1"]
    assert run.experiment == "proj"
    assert run["hparams"] == {"lr": 0.1, "layers": [2, 3], "path": "data"}
    assert not run.active
    metrics = {m.name: (m.data.indices_list(), m.values.values_list()) for m in run.metrics()}
    assert metrics["loss"][0] == [0, 1, 2]
    assert metrics["loss"][1] == pytest.approx([1.0, 0.5, 1 / 3])
    assert metrics["eval/acc"] == ([0, 1, 2], [0.0, 0.25, 0.5])
    texts = run.get_text_sequence("phase", Context({}))
    assert texts.data.indices_list() == [3]
    assert [text.data for text in texts.values.values_list()] == ["eval"]


def test_aim_failed_block_keeps_the_run_and_names_run_per_block(
    tmp_path: Path, no_network: list[str]
) -> None:
    pytest.importorskip("aim", reason="extra accel[aim] not installed")
    with pytest.raises(RuntimeError, match="boom"):
        _loop(tmp_path / "proj", "failed", fail=True)
    _loop(tmp_path / "proj", "second")
    runs = _runs(tmp_path / "proj")
    assert sorted(runs) == ["failed", "second"]  # one run per block, named after it
    failed = runs["failed"]
    assert [m.name for m in failed.metrics() if m.name == "loss"] == ["loss"]  # kept
    logs = failed.get_log_records()
    assert logs is not None
    assert any("boom" in str(record.message) for record in logs.data.values_list()[0])


def test_aim_other_ranks_create_nothing(tmp_path: Path, no_network: list[str]) -> None:
    pytest.importorskip("aim", reason="extra accel[aim] not installed")
    with fake_state(rank=1, world_size=2), accel.tracking(tmp_path, log_with="aim"):
        accel.log({"loss": 1.0}, step=0)
        assert accel.get_tracker("aim") is None
    assert list(tmp_path.iterdir()) == [tmp_path / "home"]

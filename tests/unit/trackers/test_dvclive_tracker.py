"""The ``dvclive`` tracker against the real package: DVCLive's files in the run directory,
read back with DVCLive's own readers (``read_history``, ``read_latest``, a resumed ``Live``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import accel
from accel.testing import fake_state

pytestmark = [pytest.mark.ci_extra, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _loop(project: Path, run_name: str, start: int = 0, fail: bool = False) -> Any:
    with accel.tracking(
        project, log_with="dvclive", config={"lr": 0.1, "path": Path("data")}, run_name=run_name
    ):
        for step in range(start, start + 3):
            accel.log({"loss": 1.0 / (step + 1), "eval": {"acc": step / 4}}, step=step)
        accel.log({"phase": "eval"})  # no step: DVCLive's own counter (the next step)
        live = accel.get_tracker("dvclive")
        if fail:
            raise RuntimeError("boom")
    return live


def _reader(run_dir: Path) -> Any:
    dvclive = pytest.importorskip("dvclive")
    return dvclive.Live(str(run_dir), resume=True, save_dvc_exp=False, dvcyaml=None)


def test_dvclive_files_hold_the_run(tmp_path: Path, no_network: list[str]) -> None:
    dvclive = pytest.importorskip("dvclive", reason="extra accel[dvclive] not installed")
    from dvclive.utils import parse_tsv, read_history, read_latest

    live = _loop(tmp_path / "proj", "d1")
    assert isinstance(live, dvclive.Live)
    run_dir = tmp_path / "proj" / "d1"
    reader = _reader(run_dir)
    steps, values = read_history(reader, "loss")
    assert steps == [0, 1, 2]
    assert values == pytest.approx([1.0, 0.5, 1 / 3])
    nested = parse_tsv(run_dir / "plots" / "metrics" / "eval" / "acc.tsv")  # "eval/acc"
    assert [(int(row["step"]), float(row["acc"])) for row in nested] == [
        (0, 0.0), (1, 0.25), (2, 0.5)
    ]
    assert read_latest(reader, "phase") == (3, "eval")
    assert reader.read_step() == 3
    assert reader._params == {"lr": 0.1, "path": "data"}  # what resume read from params.yaml
    assert (run_dir / "dvc.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "proj"]  # nothing elsewhere


def test_dvclive_reused_name_resumes_and_failure_keeps_files(
    tmp_path: Path, no_network: list[str]
) -> None:
    pytest.importorskip("dvclive", reason="extra accel[dvclive] not installed")
    from dvclive.utils import read_history

    with pytest.raises(RuntimeError, match="boom"):
        _loop(tmp_path / "proj", "d", fail=True)
    _loop(tmp_path / "proj", "d", start=4)  # the same run name continues the same files
    steps, _ = read_history(_reader(tmp_path / "proj" / "d"), "loss")
    assert steps == [0, 1, 2, 4, 5, 6]


def test_dvclive_other_ranks_create_nothing(tmp_path: Path, no_network: list[str]) -> None:
    pytest.importorskip("dvclive", reason="extra accel[dvclive] not installed")
    with fake_state(rank=1, world_size=2), accel.tracking(tmp_path / "proj", log_with="dvclive"):
        accel.log({"loss": 1.0}, step=0)
        assert accel.get_tracker("dvclive") is None
    assert not (tmp_path / "proj").exists()

"""The ``clearml`` tracker against the real package, in offline mode: the offline session
folder ClearML names (``Task.get_offline_mode_folder``) is read back, its config with ClearML's
own HOCON parser. ClearML keeps no task status offline, so the failed case checks the kept
session only. One test: ClearML allows one task per process and starts slowly.

Repository detection is off (``detect_repository: False``): ClearML runs ``git status`` /
``git diff`` on the repository of ``sys.argv[0]`` (here the checkout pytest runs from) in a
thread and ``Task.close`` waits up to 300 s for it; on a CI clone that wait once took the whole
test timeout. What the test reads back does not depend on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import accel
from accel.testing import fake_state

pytestmark = [pytest.mark.ci_extra, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


_NO_REPOSITORY = {"auto_connect_frameworks": {"detect_repository": False}}


def _loop(project: Path, run_name: str, fail: bool = False) -> Any:
    with accel.tracking(
        project, log_with="clearml", config={"lr": 0.1, "path": Path("data")}, run_name=run_name,
        init_kwargs={"clearml": _NO_REPOSITORY},
    ):
        for step in range(3):
            accel.log({"loss": 1.0 / (step + 1), "eval": {"acc": step / 4}}, step=step)
        accel.log({"phase": "eval"}, step=3)
        task = accel.get_tracker("clearml")
        folder = Path(task.get_offline_mode_folder())
        if fail:
            raise RuntimeError("boom")
    return task, folder


def _scalars(folder: Path) -> list[tuple[str, int, float]]:
    events = [e for line in (folder / "metrics.jsonl").read_text().splitlines()
              for e in json.loads(line)]
    return sorted((e["metric"], e["iter"], e["value"])
                  for e in events if e["type"] == "training_stats_scalar")


def test_clearml_offline_session_holds_the_run(tmp_path: Path, no_network: list[str]) -> None:
    clearml = pytest.importorskip("clearml", reason="extra accel[clearml] not installed")
    from clearml.utilities.pyhocon import ConfigFactory

    with fake_state(rank=1, world_size=2), accel.tracking(tmp_path / "proj", log_with="clearml"):
        accel.log({"loss": 1.0}, step=0)
        assert accel.get_tracker("clearml") is None
    assert not (tmp_path / "proj").exists()
    assert not (tmp_path / "clearml-cache").exists()  # other ranks start no task

    task, folder = _loop(tmp_path / "proj", "c1")
    assert isinstance(task, clearml.Task)
    assert clearml.Task.is_offline()
    assert (tmp_path / "clearml-cache") in folder.parents
    assert folder.with_suffix(".zip").is_file()  # what Task.import_offline_session uploads
    meta = json.loads((folder / "task.json").read_text())
    assert (meta["name"], meta["project_name"]) == ("c1", "proj")
    config = ConfigFactory.parse_string(meta["configuration"]["config"]["value"])
    assert dict(config) == {"lr": 0.1, "path": "data"}
    assert _scalars(folder) == sorted(
        [("loss", s, 1.0 / (s + 1)) for s in range(3)] + [("eval/acc", s, s / 4) for s in range(3)]
    )
    logs = (folder / "log.jsonl").read_text()
    assert "phase: eval" in logs

    with pytest.raises(RuntimeError, match="boom"):
        _loop(tmp_path / "proj", "failed", fail=True)  # a second task once the first closed
    sessions = sorted(p for p in (tmp_path / "clearml-cache" / "offline").iterdir() if p.is_dir())
    assert len(sessions) == 2  # one task per block
    names = sorted(json.loads((p / "task.json").read_text())["name"] for p in sessions)
    assert names == ["c1", "failed"]
    (kept,) = [p for p in sessions if json.loads((p / "task.json").read_text())["name"] == "failed"]
    assert len(_scalars(kept)) == 6  # the failed block's values are kept

"""The ``comet_ml`` tracker against the real package: an offline experiment's archive, read
back with Comet's own ``unzip_offline_archive`` (the archive is what ``comet upload`` sends)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import accel
from accel.testing import fake_state

pytestmark = [pytest.mark.ci_extra, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

_QUIET = {"comet_ml": {"display_summary_level": 0, "auto_output_logging": False}}


def _loop(project: Path, run_name: str, fail: bool = False) -> Any:
    with accel.tracking(
        project, log_with="comet_ml", config={"lr": 0.1, "path": Path("data")},
        run_name=run_name, init_kwargs=_QUIET,
    ):
        for step in range(3):
            accel.log({"loss": 1.0 / (step + 1), "eval": {"acc": step / 4}}, step=step)
        accel.log({"phase": "eval"}, step=3)
        experiment = accel.get_tracker("comet_ml")
        if fail:
            raise RuntimeError("boom")
    return experiment


def _messages(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from comet_ml.offline import unzip_offline_archive

    (archive,) = run_dir.glob("*.zip")
    folder = Path(unzip_offline_archive(str(archive)))
    try:
        meta = json.loads((folder / "experiment.json").read_text())
        lines = (folder / "messages.json").read_text().splitlines()
    finally:
        for path in sorted(folder.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        folder.rmdir()
    return meta, [json.loads(line) for line in lines]


def _others(messages: list[dict[str, Any]]) -> dict[str, Any]:
    others = [m["payload"] for m in messages if m["type"] == "log_other"]
    return {payload["key"]: payload["value"] for payload in others}


def test_comet_offline_archive_holds_the_run(tmp_path: Path, no_network: list[str]) -> None:
    comet_ml = pytest.importorskip("comet_ml", reason="extra accel[comet_ml] not installed")
    experiment = _loop(tmp_path / "proj", "c1")
    assert isinstance(experiment, comet_ml.OfflineExperiment)
    meta, messages = _messages(tmp_path / "proj" / "c1")
    assert meta["project_name"] == "proj"
    metrics = [
        (m["payload"]["metric"]["metricName"], m["payload"]["metric"]["step"],
         m["payload"]["metric"]["metricValue"])
        for m in messages
        if m["type"] == "metric_msg"
        and m["payload"]["metric"]["metricName"] in ("loss", "eval/acc")
    ]
    assert sorted(metrics) == sorted(
        [("loss", s, 1.0 / (s + 1)) for s in range(3)] + [("eval/acc", s, s / 4) for s in range(3)]
    )
    params = {
        m["payload"]["param"]["paramName"]: m["payload"]["param"]["paramValue"]
        for m in messages
        if m["type"] == "parameter_msg" and m["payload"]["param"]["source"] == "manual"
    }
    assert params == {"lr": 0.1, "path": "data"}
    others = _others(messages)
    assert others["Name"] == "c1"
    assert others["phase"] == "eval"
    assert "accel_error" not in others


def test_comet_failed_block_keeps_the_archive(tmp_path: Path, no_network: list[str]) -> None:
    pytest.importorskip("comet_ml", reason="extra accel[comet_ml] not installed")
    with pytest.raises(RuntimeError, match="boom"):
        _loop(tmp_path / "proj", "failed", fail=True)
    _loop(tmp_path / "proj", "second")
    _, failed = _messages(tmp_path / "proj" / "failed")
    assert "boom" in _others(failed)["accel_error"]
    assert any(m["type"] == "metric_msg" for m in failed)
    _, second = _messages(tmp_path / "proj" / "second")  # one experiment per block
    assert _others(second)["Name"] == "second"


def test_comet_other_ranks_create_nothing(tmp_path: Path, no_network: list[str]) -> None:
    pytest.importorskip("comet_ml", reason="extra accel[comet_ml] not installed")
    with fake_state(rank=1, world_size=2), accel.tracking(tmp_path / "proj", log_with="comet_ml"):
        accel.log({"loss": 1.0}, step=0)
        assert accel.get_tracker("comet_ml") is None
    assert not (tmp_path / "proj").exists()

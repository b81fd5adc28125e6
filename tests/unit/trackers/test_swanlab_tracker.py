"""The ``swanlab`` tracker against the real package: an offline run, read back from its
``.swanlab`` record file with SwanLab's own ``DataStoreReader`` and record protobufs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from accel.testing import fake_state

pytestmark = [pytest.mark.ci_extra, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _loop(project: Path, run_name: str, fail: bool = False) -> Any:
    with accel.tracking(
        project, log_with="swanlab", config={"lr": 0.1, "path": Path("data")}, run_name=run_name
    ):
        for step in range(3):
            loss = torch.tensor(1.0 / (step + 1))
            accel.log({"loss": loss, "eval": {"acc": step / 4}}, step=step)
        accel.log({"phase": "eval"}, step=3)
        run = accel.get_tracker("swanlab")
        if fail:
            raise RuntimeError("boom")
    return run


def _records(run_dir: Path) -> list[Any]:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = run_dir.glob("run-*/*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    records = []
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        records.append(record)
    reader.close()
    return records


def _kind(record: Any) -> str | None:
    return record.WhichOneof(record.DESCRIPTOR.oneofs[0].name)


def test_swanlab_offline_run_is_read_back(tmp_path: Path, no_network: list[str]) -> None:
    pytest.importorskip("swanlab", reason="extra accel[swanlab] not installed")
    yaml = pytest.importorskip("yaml")
    run = _loop(tmp_path / "proj", "s1")
    assert type(run).__name__ == "Run" and type(run).__module__.startswith("swanlab")
    records = _records(tmp_path / "proj" / "s1")
    (start,) = [r.start for r in records if _kind(r) == "start"]
    assert (start.project, start.name) == ("proj", "s1")
    scalars = [(r.scalar.key, r.scalar.step, r.scalar.value.number)
               for r in records if _kind(r) == "scalar"]
    assert sorted(scalars) == sorted(
        [("loss", s, pytest.approx(1.0 / (s + 1))) for s in range(3)]
        + [("eval/acc", s, s / 4) for s in range(3)]
    )
    (text,) = [r.media for r in records if _kind(r) == "media"]
    assert (text.key, text.step) == ("phase", 3)
    (item,) = text.value.items
    (stored,) = (tmp_path / "proj" / "s1").glob(f"run-*/media/text/{item.filename}")
    assert stored.read_text() == "eval"
    (finish,) = [r.finish for r in records if _kind(r) == "finish"]
    assert finish.state == finish.DESCRIPTOR.fields_by_name["state"].enum_type.values_by_name[
        "RUN_STATE_FINISHED"].number
    (config_file,) = (tmp_path / "proj" / "s1").glob("run-*/files/config.yaml")
    config = yaml.safe_load(config_file.read_text())
    assert {k: (v["value"] if isinstance(v, dict) else v) for k, v in config.items()
            if k in ("lr", "path")} == {"lr": 0.1, "path": "data"}


def test_swanlab_failed_block_is_crashed_and_kept(tmp_path: Path, no_network: list[str]) -> None:
    pytest.importorskip("swanlab", reason="extra accel[swanlab] not installed")
    with pytest.raises(RuntimeError, match="boom"):
        _loop(tmp_path / "proj", "failed", fail=True)
    _loop(tmp_path / "proj", "second")
    records = _records(tmp_path / "proj" / "failed")
    (finish,) = [r.finish for r in records if _kind(r) == "finish"]
    states = finish.DESCRIPTOR.fields_by_name["state"].enum_type.values_by_number
    assert states[finish.state].name == "RUN_STATE_CRASHED"
    assert "boom" in finish.error
    assert any(_kind(r) == "scalar" for r in records)
    (start,) = [r.start for r in _records(tmp_path / "proj" / "second") if _kind(r) == "start"]
    assert start.name == "second"


def test_swanlab_other_ranks_create_nothing(tmp_path: Path, no_network: list[str]) -> None:
    pytest.importorskip("swanlab", reason="extra accel[swanlab] not installed")
    with fake_state(rank=1, world_size=2), accel.tracking(tmp_path / "proj", log_with="swanlab"):
        accel.log({"loss": 1.0}, step=0)
        assert accel.get_tracker("swanlab") is None
    assert not (tmp_path / "proj").exists()

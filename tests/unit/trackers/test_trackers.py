from __future__ import annotations

import glob
import importlib.util
import json
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import accel
from accel import trackers as tracking_module
from accel.errors import ConfigError, LogValueError, TrackerUnavailableError, TrackingNotActiveError
from accel.testing import fake_state
from accel.trackers.jsonl import read_jsonl


class RecordingTracker:
    """A custom tracker following the protocol of accel.trackers.base."""

    name = "recording"

    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, Any], int | None]] = []
        self.config: dict[str, Any] | None = None
        self.errors: list[BaseException] = []
        self.finished = 0

    def store_config(self, config: dict[str, Any]) -> None:
        self.config = config

    def log(self, values: dict[str, Any], step: int | None) -> None:
        self.rows.append((dict(values), step))

    def on_error(self, exc: BaseException) -> None:
        self.errors.append(exc)

    def finish(self) -> None:
        self.finished += 1


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "metrics.jsonl")


def test_jsonl_rows_match_what_was_logged(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    config = {"lr": 0.1, "layers": [1, 2], "path": Path("x")}
    with accel.tracking(tmp_path, config=config, run_name="exp") as run:
        assert run.directory == tmp_path / "exp"
        assert run.name == "exp"
        assert run.active
        accel.log({"loss": torch.tensor(0.5), "acc": np.float32(0.25)}, step=1)
        accel.log({"eval": {"acc": 0.75, "n": np.int64(3)}, "ok": True, "note": "hi"}, step=2)
        accel.log({"loss": 1.5})
        tracker = accel.get_tracker("jsonl")
        assert not tracker.closed
    assert tracker.closed
    rows = _rows(tmp_path / "exp")
    assert [r["step"] for r in rows] == [1, 2, None]
    assert all(isinstance(r["time"], float) for r in rows)
    values = [{k: v for k, v in r.items() if k not in ("step", "time")} for r in rows]
    assert values == [
        {"loss": 0.5, "acc": 0.25},
        {"eval/acc": 0.75, "eval/n": 3, "ok": 1, "note": "hi"},
        {"loss": 1.5},
    ]
    saved = json.loads((tmp_path / "exp" / "config.json").read_text())
    assert saved == {"lr": 0.1, "layers": [1, 2], "path": "x"}


@settings(max_examples=25, deadline=None)
@given(
    values=st.dictionaries(
        st.text(min_size=1, max_size=8).filter(lambda k: k not in ("step", "time")),
        st.one_of(
            st.integers(-(2**40), 2**40),
            st.floats(allow_nan=False, allow_infinity=False),
            st.text(max_size=10),
        ),
        max_size=6,
    ),
    step=st.one_of(st.none(), st.integers(0, 10**9)),
)
def test_jsonl_round_trips_any_scalars(tmp_path_factory: Any, values: Any, step: Any) -> None:
    root = tmp_path_factory.mktemp("runs")
    with accel.tracking(root, run_name="r"):
        accel.log(values, step=step)
    (row,) = _rows(root / "r")
    assert row.pop("step") == step
    row.pop("time")
    assert row == values


def test_non_main_rank_writes_nothing(tmp_path: Path) -> None:
    custom = RecordingTracker()
    with fake_state(rank=1, world_size=2), accel.tracking(
        tmp_path, log_with=("jsonl", custom), config={"a": 1}
    ) as run:
        assert run.directory is None
        assert not run.active
        assert run.trackers == {}
        assert run.tracker_names == ("jsonl", "recording")
        accel.log({"loss": 1.0}, step=1)
        accel.log({"not even checked": object()})  # other ranks do no work at all
        assert accel.get_tracker("jsonl") is None
        with pytest.raises(ConfigError, match="tensorboard"):
            accel.get_tracker("tensorboard")
    assert list(tmp_path.iterdir()) == []
    assert custom.rows == []
    assert custom.finished == 0
    assert custom.config is None


def test_log_outside_tracking() -> None:
    with pytest.raises(TrackingNotActiveError, match=r"accel\.tracking"):
        accel.log({"loss": 1.0})
    with pytest.raises(TrackingNotActiveError, match="outside"):
        accel.get_tracker("jsonl")
    with fake_state(rank=3, world_size=4):
        accel.log({"loss": 1.0})  # documented no-op on non-main ranks


def test_bad_values_are_refused_not_dropped(tmp_path: Path) -> None:
    with accel.tracking(tmp_path, run_name="r"):
        with pytest.raises(LogValueError, match=r"shape \(3,\)"):
            accel.log({"vec": torch.ones(3)})
        with pytest.raises(LogValueError, match="object"):
            accel.log({"thing": object()})
        with pytest.raises(LogValueError, match="string keys"):
            accel.log({1: 2.0})  # type: ignore[dict-item]
        with pytest.raises(LogValueError, match="dict of values"):
            accel.log([("loss", 1.0)])  # type: ignore[arg-type]
        with pytest.raises(LogValueError, match="step"):
            accel.log({"loss": 1.0}, step=1.5)  # type: ignore[arg-type]
        with pytest.raises(LogValueError, match="reserved"):
            accel.log({"step": 3})
        accel.log({"loss": 2.0}, step=torch.tensor(4))  # type: ignore[arg-type]
    assert [(r["step"], r["loss"]) for r in _rows(tmp_path / "r")] == [(4, 2.0)]


def test_none_values_are_skipped_with_one_warning_per_key(tmp_path: Path) -> None:
    # diffusers' EMAModel reports decay=None before its first step; the loop logs it as is
    custom = RecordingTracker()
    with accel.tracking(tmp_path, log_with=("jsonl", custom), run_name="r"):
        with pytest.warns(UserWarning, match="value is None") as said:
            accel.log({"loss": 1.0, "ema_decay": None, "eval": {"acc": None}}, step=0)
        assert sorted(str(w.message).split("'")[1] for w in said) == ["ema_decay", "eval/acc"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same keys again: no second warning
            accel.log({"loss": 2.0, "ema_decay": None}, step=1)
            accel.log({"ema_decay": None}, step=2)  # nothing left: no row at all
        accel.log({"loss": 3.0, "ema_decay": 0.5}, step=3)
    assert [(r["step"], r.get("ema_decay")) for r in _rows(tmp_path / "r")] == [
        (0, None),
        (1, None),
        (3, 0.5),
    ]
    assert custom.rows == [
        ({"loss": 1.0}, 0),
        ({"loss": 2.0}, 1),
        ({"loss": 3.0, "ema_decay": 0.5}, 3),
    ]
    with (
        fake_state(rank=1, world_size=2),
        accel.tracking(tmp_path, log_with=("jsonl",), run_name="r2"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")  # other ranks convert nothing, so say nothing
        accel.log({"ema_decay": None})
    with (
        accel.tracking(tmp_path, log_with=(custom,), run_name="r3"),
        pytest.warns(UserWarning, match="'ema_decay'"),  # a new block says it again
    ):
        accel.log({"ema_decay": None}, step=0)


def _fail_inside(root: Path, message: str, out: dict[str, Any], **options: Any) -> None:
    """Log twice inside a tracking block, then raise; ``out`` gets the native trackers."""
    with accel.tracking(root, **options) as run:
        accel.log({"loss": 0.5}, step=1)
        accel.log({"loss": 0.25, "phase": "eval"}, step=2)
        out.update({name: accel.get_tracker(name) for name in run.tracker_names})
        raise RuntimeError(message)


def _enter(root: Path, **options: Any) -> None:
    with accel.tracking(root, **options):
        pass


def test_trackers_finish_after_an_exception(tmp_path: Path) -> None:
    custom = RecordingTracker()
    natives: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="boom"):
        _fail_inside(tmp_path, "boom", log_with=["jsonl", custom], run_name="r", out=natives)
    assert natives["jsonl"].closed
    assert custom.finished == 1
    assert [str(e) for e in custom.errors] == ["boom"]
    assert len(_rows(tmp_path / "r")) == 2
    with pytest.raises(TrackingNotActiveError):  # the run is no longer active
        accel.log({"loss": 1.0})


def test_custom_tracker_gets_config_values_and_is_returned(tmp_path: Path) -> None:
    custom = RecordingTracker()
    with accel.tracking(tmp_path, log_with=custom, config={"lr": 1e-3}) as run:  # type: ignore[arg-type]
        accel.log({"loss": torch.tensor([2.0])}, step=7)
        assert accel.get_tracker("recording") is custom
    assert run.tracker_names == ("recording",)
    assert custom.config == {"lr": 1e-3}
    assert custom.rows == [({"loss": 2.0}, 7)]
    assert custom.finished == 1
    assert list(tmp_path.iterdir()) == []  # no builtin tracker: no run directory


def test_a_failing_finish_does_not_skip_the_others(tmp_path: Path) -> None:
    class Broken(RecordingTracker):
        name = "broken"

        def finish(self) -> None:
            super().finish()
            raise OSError("disk full")

    broken, after = Broken(), RecordingTracker()
    with pytest.raises(OSError, match="disk full"):
        _enter(tmp_path, log_with=[broken, after])
    assert broken.finished == 1
    assert after.finished == 1


def test_log_inside_main_process_function(tmp_path: Path) -> None:
    @accel.on_main_process
    def report(step: int) -> None:
        accel.log({"step_loss": float(step)}, step=step)

    with accel.tracking(tmp_path, run_name="r"):
        report(1)
        report(2)
    assert [r["step_loss"] for r in _rows(tmp_path / "r")] == [1.0, 2.0]


def test_tracking_inside_main_process_function(tmp_path: Path) -> None:
    @accel.on_main_process
    def save_summary() -> None:
        with accel.tracking(tmp_path, run_name="summary"):
            accel.log({"final": 1.0})

    save_summary()
    assert _rows(tmp_path / "summary")[0]["final"] == 1.0


def test_log_with_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'jsonl', 'tensorboard', 'wandb', 'mlflow'"):
        _enter(tmp_path, log_with=("comet_typo",))
    with pytest.raises(ConfigError, match="twice"):
        _enter(tmp_path, log_with=("jsonl", "JSONL"))
    with pytest.raises(ConfigError, match="tracker objects"):
        _enter(tmp_path, log_with=(3,))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not in log_with"):
        _enter(tmp_path, init_kwargs={"wandb": {"mode": "offline"}})
    with pytest.raises(ConfigError, match="config must be"):
        _enter(tmp_path, config=3)
    assert list(tmp_path.iterdir()) == []


def test_missing_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracking_module, "_installed", lambda package: package is None)
    with pytest.raises(TrackerUnavailableError, match=r"pip install 'accel\[tensorboard\]'"):
        _enter(tmp_path, log_with=("jsonl", "tensorboard"))
    assert isinstance(TrackerUnavailableError("x"), ImportError)
    assert list(tmp_path.iterdir()) == []  # nothing started before the check
    with accel.tracking(tmp_path, log_with="all", run_name="r") as run:
        assert run.tracker_names == ("jsonl",)


def test_log_with_all_picks_installed() -> None:
    expected = ["jsonl"] + [
        name
        for name in (
            "tensorboard", "wandb", "mlflow", "aim", "comet_ml", "clearml", "dvclive", "swanlab",
            "trackio",
        )
        if importlib.util.find_spec(name) is not None
    ]
    assert tracking_module._resolve("all") == expected
    assert tracking_module._resolve("ALL") == expected
    custom = RecordingTracker()
    assert tracking_module._resolve([custom, "all"]) == [custom, *expected]
    assert tracking_module._resolve(["jsonl", "all"]) == expected


def test_default_run_names_are_unique_and_nesting_restores(tmp_path: Path) -> None:
    with accel.tracking(tmp_path) as outer:
        with accel.tracking(tmp_path) as inner:
            accel.log({"inner": 1})
        accel.log({"outer": 1})
    assert outer.name != inner.name
    assert outer.name is not None
    assert outer.name.startswith("run-")
    assert outer.directory is not None
    assert inner.directory is not None
    assert "inner" in _rows(inner.directory)[0]
    assert "outer" in _rows(outer.directory)[0]
    with accel.tracking(tmp_path, run_name=outer.name):  # reusing a name appends
        accel.log({"again": 2})
    assert len(_rows(outer.directory)) == 2


def test_empty_log_with_logs_nothing(tmp_path: Path) -> None:
    with accel.tracking(tmp_path, log_with=()) as run:
        accel.log({"loss": 1.0})
        assert not run.active
    assert list(tmp_path.iterdir()) == []


# --- optional adapters, each tested for real (offline / local) ---------------------------


def test_tensorboard_event_files_hold_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="extra accel[tensorboard] not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with accel.tracking(tmp_path, log_with=("tensorboard",), config={"lr": 0.1}, run_name="tb"):
        for step in range(3):
            accel.log({"loss": 1.0 / (step + 1), "eval": {"acc": step / 4}}, step=step)
        accel.log({"note": "text"}, step=3)
        writer = accel.get_tracker("tensorboard")
        assert type(writer).__name__ == "SummaryWriter"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/acc", "loss"]
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx([1.0, 0.5, 1 / 3])
    assert [e.value for e in events.Scalars("eval/acc")] == [0.0, 0.25, 0.5]
    assert {"config/text_summary", "note/text_summary"} <= set(events.Tags()["tensors"])


def _wandb_records(path: str) -> list[Any]:
    """Read a .wandb file (leveldb-log records of protobuf Records) without a network."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    block, pos, records, pending = 32768, 7, [], b""  # 7-byte file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.ci_extra
def test_wandb_offline_run_holds_the_metrics(tmp_path: Path) -> None:
    wandb = pytest.importorskip("wandb", reason="extra accel[wandb] not installed")
    options = {"wandb": {"mode": "offline", "settings": {"silent": True}}}
    with accel.tracking(
        tmp_path / "proj", log_with="wandb", config={"lr": 0.1}, run_name="w", init_kwargs=options
    ):
        accel.log({"loss": 0.5}, step=1)
        accel.log({"loss": 0.25, "acc": torch.tensor(0.75)}, step=2)
        run = accel.get_tracker("wandb")
        assert run.name == "w"
        assert run.project == "proj"
        assert dict(run.config) == {"lr": 0.1}
    wandb.teardown()  # stops wandb's service process (and drops its WANDB_SERVICE variable)
    (path,) = glob.glob(str(tmp_path / "proj" / "w" / "wandb" / "offline-run-*" / "*.wandb"))
    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in _wandb_records(path)
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["loss"], h.get("acc")) for h in history] == [
        (1, 0.5, None),
        (2, 0.25, 0.75),
    ]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inside mlflow/sqlalchemy
@pytest.mark.slow  # importing mlflow and creating its sqlite store takes seconds
@pytest.mark.ci_extra
def test_mlflow_local_run_holds_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="extra accel[mlflow] not installed")
    from mlflow import MlflowClient

    natives: dict[str, Any] = {}
    options = {"log_with": "mlflow", "config": {"lr": 0.1, "name": "x"}, "run_name": "m"}
    with pytest.raises(RuntimeError, match="fail"):
        _fail_inside(tmp_path, "fail", natives, **options)
    tracker = natives["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    history = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]
    run = client.get_run(tracker.run_id)
    assert run.data.params == {"lr": "0.1", "name": "x"}
    assert run.data.tags["phase"] == "eval"
    assert run.info.run_name == "m"
    assert run.info.status == "FAILED"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # inside mlflow/sqlalchemy
@pytest.mark.slow  # creating an mlflow sqlite store takes seconds
def test_mlflow_honours_its_own_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="extra accel[mlflow] not installed")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    with accel.tracking(tmp_path / "proj", log_with="mlflow", run_name="e"):
        accel.log({"loss": 1.0}, step=0)
        run_id = accel.get_tracker("mlflow").run_id
    assert not (tmp_path / "proj" / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "from-env"
    assert run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [1.0]

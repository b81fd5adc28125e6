"""Tracking on 2 and 3 real processes: only rank 0 writes, and trackers close on errors."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import accel
from accel.testing import run_distributed
from accel.trackers.jsonl import read_jsonl

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@accel.on_main_process
def _report(step: int) -> None:
    accel.log({"from_gate": float(step)}, step=step)


def _tracking_body(root: str, log_with: tuple[str, ...]) -> dict[str, Any]:
    st = accel.state()
    out: dict[str, Any] = {}
    with accel.tracking(root, log_with=log_with, config={"world": st.world_size}) as run:
        out["directory"] = None if run.directory is None else str(run.directory)
        out["active"] = run.active
        for step in range(3):
            # the same call on every rank; the rank in the values shows who wrote
            loss = accel.reduce(torch.tensor(float(step + 1)), "mean")
            accel.log({"loss": loss, "rank": st.rank}, step=step)
        _report(3)
        out["jsonl_is_none"] = accel.get_tracker("jsonl") is None
    # a block that raises on every rank: the trackers are finished anyway
    try:
        with accel.tracking(root, log_with=log_with, run_name="failing") as failing:
            accel.log({"before": 1.0}, step=0)
            raise ValueError(f"boom on rank {st.rank}")
    except ValueError as exc:
        out["error"] = str(exc)
    out["closed"] = [t.closed for t in failing.trackers.values()]  # type: ignore[attr-defined]
    accel.wait_for_everyone()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_only_rank_zero_writes(tmp_path: Path, world_size: int) -> None:
    log_with = ("jsonl", "tensorboard") if HAS_TENSORBOARD else ("jsonl",)
    results = run_distributed(_tracking_body, str(tmp_path), log_with, world_size=world_size)
    main, others = results[0], results[1:]
    assert main["active"]
    assert main["directory"] is not None
    assert not main["jsonl_is_none"]
    assert all(not o["active"] and o["directory"] is None and o["jsonl_is_none"] for o in others)
    assert [r["error"] for r in results] == [f"boom on rank {r}" for r in range(world_size)]
    assert main["closed"] == [True] * len(log_with)
    assert all(o["closed"] == [] for o in others)

    run_dir = Path(main["directory"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([run_dir.name, "failing"])
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["step"], r.get("loss"), r.get("rank")) for r in rows] == [
        (0, 1.0, 0),
        (1, 2.0, 0),
        (2, 3.0, 0),
        (3, None, None),
    ]
    assert rows[3]["from_gate"] == 3.0
    assert (run_dir / "config.json").read_text().count(f'"world": {world_size}') == 1
    assert len(read_jsonl(tmp_path / "failing" / "metrics.jsonl")) == 1

    if HAS_TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = sorted(run_dir.glob("events.out.tfevents.*"))
        assert len(events) == 1  # one writer: rank 0's
        accumulator = EventAccumulator(str(run_dir))
        accumulator.Reload()
        assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [
            (0, 1.0),
            (1, 2.0),
            (2, 3.0),
        ]
        assert [e.value for e in accumulator.Scalars("rank")] == [0.0, 0.0, 0.0]
        assert [(e.step, e.value) for e in accumulator.Scalars("from_gate")] == [(3, 3.0)]

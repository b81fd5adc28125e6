"""Smoke run of bench/liveness.py (issue 39): two processes posing as two machines, tiny
windows; the report's structure and the proof that the watch ran in the 'on' windows are
checked, never the timings."""

from __future__ import annotations

import json
import pathlib

import pytest

from accel.testing import run_script
from tests.bench_modules import BENCH

ROW_KEYS = {
    "heartbeat_interval_s", "liveness_timeout_s", "model_params", "windows", "steps_per_window",
    "window_s_median", "step_us_off", "step_us_on", "ratio_on_off_median",
    "ratio_on_off_p25_p75", "watch", "rank1_ratio_on_off_median",
    "rank1_watch_rounds_per_s_running", "control",
}


@pytest.mark.ci_extra
@pytest.mark.slow
def test_liveness_bench_smoke_run(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "liveness.json"
    result = run_script(BENCH / "liveness.py", "--rows", "stress", "--windows", "2",
                        "--json-out", str(out), world_size=1, launch=False, timeout=240)
    report = json.loads(out.read_text())
    assert json.loads(result.stdout[0]) == report
    assert report["num_nodes_seen"] == [2, 2]  # accel.distributed() saw two machines
    row = report["rows"]["stress"]
    assert set(row) == ROW_KEYS
    assert row["heartbeat_interval_s"] == 0.05 and row["windows"] == 2
    assert row["control"] is False
    assert row["steps_per_window"] >= 1 and len(row["ratio_on_off_p25_p75"]) == 2
    watch = row["watch"]
    assert watch["every_on_window_warmed"] is True
    assert watch["rounds_in_on_windows"] > 0 and watch["peer_rounds_heard_in_on_windows"] > 0
    assert watch["rounds_per_s_running"] > 0 and watch["rounds_per_s_aimed"] == 20.0


@pytest.mark.ci_extra
@pytest.mark.slow
def test_liveness_bench_with_fixed_steps_still_proves_the_watch_ran(
        tmp_path: pathlib.Path) -> None:
    out = tmp_path / "liveness.json"
    run_script(BENCH / "liveness.py", "--rows", "stress", "--windows", "1", "--steps", "3",
               "--json-out", str(out), world_size=1, launch=False, timeout=240)
    row = json.loads(out.read_text())["rows"]["stress"]
    assert row["steps_per_window"] == 3 and row["windows"] == 1
    assert row["watch"]["every_on_window_warmed"] is True  # a round heard the other rank
    assert row["watch"]["rounds_per_s_running"] > 0


@pytest.mark.ci_extra
@pytest.mark.slow
def test_liveness_bench_control_run_starts_no_watch(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "liveness.json"
    run_script(BENCH / "liveness.py", "--rows", "stress", "--windows", "1", "--steps", "3",
               "--control", "--json-out", str(out), world_size=1, launch=False, timeout=240)
    row = json.loads(out.read_text())["rows"]["stress"]
    assert row["control"] is True and set(row) == ROW_KEYS
    assert row["watch"]["rounds_in_on_windows"] == 0

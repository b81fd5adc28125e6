"""Smoke runs of bench/curves_step.py and bench/curves_prepare.py with tiny sizes (issue 43).

Each writes its curve files (the schema bench/plot_curves.py checks) into a temporary folder;
the figures themselves are not judged here (no timing is asserted), only that every curve
and point is there and the per-step call counts were taken.
"""

from __future__ import annotations

import json
import pathlib
from types import ModuleType

import pytest

from accel.testing import run_script
from tests.bench_modules import BENCH, load_bench

SETTINGS = ("1proc", "ddp2", "fsdp2")


def _plot_curves() -> ModuleType:
    return load_bench("plot_curves")


def _curves(folder: pathlib.Path) -> dict[str, dict]:
    validate = _plot_curves().validate
    return {f.stem: validate(json.loads(f.read_text()), str(f)) for f in folder.glob("*.json")}


@pytest.mark.ci_extra
@pytest.mark.slow
def test_curves_step_smoke_run(tmp_path: pathlib.Path) -> None:
    run_script(BENCH / "curves_step.py", "--tensors", "2", "8", "--windows", "2",
               "--window-ms", "2", "--json-out", str(tmp_path), world_size=1, launch=False,
               env={"OMP_NUM_THREADS": "1"})
    curves = _curves(tmp_path)
    assert set(curves) == {f"step_overhead_{s}{a}" for s in SETTINGS for a in ("", "_acc4")}
    for name, curve in curves.items():
        assert curve["series"][0]["name"] == "accel"
        for entry in curve["series"] + curve["derived"]:
            assert [n for n, _ in entry["points"]] == [2, 8], name
        assert all(us > 0 for entry in curve["series"] for _, us in entry["points"])
        added = dict(curve["accel_added_calls_per_step"])
        assert set(added) == {2, 8}
        # accel adds the same calls per step at both sizes (FSDP2 with accumulation: fewer
        # than the raw loop's set_requires_gradient_sync, which walks the modules)
        assert added[8] <= added[2], (name, added)


@pytest.mark.ci_extra
@pytest.mark.slow
def test_curves_prepare_smoke_run(tmp_path: pathlib.Path) -> None:
    run_script(BENCH / "curves_prepare.py", "--tensors", "2", "8", "--repeat", "2",
               "--json-out", str(tmp_path), world_size=1, launch=False,
               env={"OMP_NUM_THREADS": "1"})
    curves = _curves(tmp_path)
    assert set(curves) == {f"prepare_model_{s}" for s in SETTINGS}
    for curve in curves.values():
        assert len(curve["series"]) == 2
        for entry in curve["series"]:
            assert [n for n, _ in entry["points"]] == [2, 8]
            assert all(ms > 0 for _, ms in entry["points"])
        assert all(ratio > 0 for _, ratio in curve["derived"][0]["points"])

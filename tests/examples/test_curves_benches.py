"""Smoke runs of the cost-curve benches of issue 43 (parts 1c-1f) with tiny sizes: each writes
valid curve JSON (read back by bench/plot_curves.py) holding every point it was asked for, and
removes its checkpoints. Timings are never asserted."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from accel.testing import run_script
from tests.bench_modules import BENCH, load_bench

ENV = {"OMP_NUM_THREADS": "1"}

pytestmark = [pytest.mark.ci_extra, pytest.mark.slow]


def _plotter() -> ModuleType:
    return load_bench("plot_curves")


def _curves(out: Path) -> dict[str, dict[str, Any]]:
    return {curve["curve"]: curve for _, curve in _plotter().read_curves([out])}


def _xs(curve: dict[str, Any]) -> list[list[float]]:
    return [[p[0] for p in series["points"]] for series in curve["series"]]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="needs the deepspeed extra")
def test_deepspeed_curves(tmp_path: Path) -> None:
    run_script(BENCH / "curves_deepspeed.py", "--widths", "8", "16", "--layers", "1",
               "--batch", "2", "--windows", "2", "--steps", "1", "--procs", "1", "2",
               "--stages", "2", "3", "--profile", "--json-out", str(tmp_path), world_size=1,
               launch=False, env=ENV, timeout=300)
    curves = _curves(tmp_path)
    assert set(curves) == {f"deepspeed_zero{s}_{p}proc" for s in (2, 3) for p in (1, 2)}
    for curve in curves.values():
        assert [s["name"] for s in curve["series"]] == ["accel", "raw deepspeed.initialize"]
        # Linear(8, 8) + head, Linear(16, 16) + head: weights and biases
        assert _xs(curve) == [[144, 544]] * 2
        assert [p["width"] for p in curve["points"]] == [8, 16]
        assert all(isinstance(p["overhead_pct"], float) for p in curve["points"])
        assert all(p["cprofile_top"] for p in curve["points"])
        assert isinstance(curve["goal_met"], bool)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
def test_context_parallel_curve(tmp_path: Path) -> None:
    run_script(BENCH / "curves_cp.py", "--seqs", "8", "16", "32", "--hidden", "32",
               "--layers", "1", "--windows", "2", "--steps", "1", "--json-out", str(tmp_path),
               world_size=1, launch=False, env=ENV, timeout=300)
    curve = _curves(tmp_path)["cp_tokens_per_rank"]
    assert _xs(curve) == [[8, 16, 32]] * 2
    assert [s["name"] for s in curve["series"]] == ["cp=1 (1 process)", "cp=2 (2 processes)"]
    assert all(p["cp1_step_ms"] > 0 and p["cp2_step_ms"] > 0 for p in curve["points"])


def test_checkpoint_curves(tmp_path: Path) -> None:
    where, out = tmp_path / "files", tmp_path / "json"
    where.mkdir()
    run_script(BENCH / "curves_checkpoint.py", "--sizes", "0.0005", "0.002", "--rank-gb",
               "0.0005", "--ranks", "1", "2", "4", "--repeat", "1", "--dir", str(where),
               "--json-out", str(out), world_size=1, launch=False, env=ENV, timeout=300)
    curves = _curves(out)
    size, ranks = curves["checkpoint_size"], curves["checkpoint_ranks"]
    assert [s["name"] for s in size["series"]] == [
        "accel save (save_state)", "safetensors save (save_file)", "accel load (load_state)",
        "safetensors load (load_file)"]
    # 8 x Linear(w, w), w = sqrt(size / 4 B / 8): 125 and 250
    assert [p["width"] for p in size["points"]] == [125, 250]
    assert [p["bytes"] for p in size["points"]] == [8 * (w * w + w) * 4 for w in (125, 250)]
    assert all(p["save_ratio"] > 0 and p["save_cpu_ratio"] > 0 for p in size["points"])
    assert _xs(ranks) == [[1, 2, 4]] * 2
    # weights, biases and two AdamW moments of 8 x Linear(125, 125), whatever the ranks
    assert {p["state_gb"] for p in ranks["points"]} == {round(8 * (125 * 125 + 125) * 12 / 1e9,
                                                              3)}
    assert os.listdir(where) == []  # every checkpoint removed


def test_gather_curve(tmp_path: Path) -> None:
    run_script(BENCH / "curves_gather.py", "--ranks", "1", "2", "--rows", "4", "64",
               "--windows", "2", "--calls", "2", "--json-out", str(tmp_path), world_size=1,
               launch=False, env=ENV, timeout=300)
    curve = _curves(tmp_path)["gather_for_metrics"]
    assert [s["name"] for s in curve["series"]] == [
        "accel 256 B/rank", "raw 256 B/rank", "accel 4 KiB/rank", "raw 4 KiB/rank"]
    assert _xs(curve) == [[1, 2]] * 4
    assert len(curve["derived"]) == 2

"""bench/plot_curves.py: the curve JSON is read and checked (every committed bench/curves file
too), bad files are named with their field, and a PNG is drawn when matplotlib is installed
(the ``bench`` extra; CI's venv may not have it: then the drawing is skipped; the drawing
runs in the ci_extra step)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.bench_modules import BENCH, load_bench


def _plotter() -> ModuleType:
    return load_bench("plot_curves")


SAMPLE: dict[str, Any] = {
    "curve": "tiny_sample",
    "title": "Step time vs parameter tensors",
    "x": {"label": "parameter tensors", "scale": "log"},
    "y": {"label": "us per step", "scale": "log"},
    "series": [
        {"name": "accel", "points": [[2, 812.0], [40, 1500.3], [400, 9000.0]],
         "spread": [[800.0, 820.0], [1490.0, 1510.0], [8900.0, 9100.0]]},
        {"name": "raw", "points": [[2, 805.1], [40, 1499.0], [400, 8990.0]]},
    ],
    "derived": [{"name": "overhead us", "points": [[2, 6.9], [40, -1.3], [400, 10.0]]}],
    "command": "python bench/curves_step.py --windows 40",
    "when": "2026-12-02T08:40Z", "load_average": "1.1 0.9 0.8", "torch": "2.13.0",
}


def test_a_sample_reads_back_and_its_stem_must_match(tmp_path: Path) -> None:
    plot = _plotter()
    (tmp_path / "tiny_sample.json").write_text(json.dumps(SAMPLE))
    [(file, curve)] = plot.read_curves([tmp_path])
    assert file.name == "tiny_sample.json" and curve == SAMPLE
    (tmp_path / "other.json").write_text(json.dumps(SAMPLE))
    with pytest.raises(plot.CurveError, match="file stem 'other'"):
        plot.read_curves([tmp_path])
    (tmp_path / "other.json").write_text("{not json")
    with pytest.raises(plot.CurveError, match="not readable as JSON"):
        plot.read_curves([tmp_path / "other.json"])
    assert plot.main([str(tmp_path / "tiny_sample.json"), "--check"]) == 0
    assert plot.main([str(tmp_path), "--check"]) == 1  # other.json is refused


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c.pop("command"), r"missing field\(s\) \['command'\]"),
    (lambda c: c["x"].update(scale="cubic"), "x.scale 'cubic'"),
    (lambda c: c.update(series=[]), "'series' must be a non-empty list"),
    (lambda c: c["series"][0]["points"].append([1, "fast"]), r"point \[1, 'fast'\]"),
    (lambda c: c["series"][1]["points"].__setitem__(0, [0, 5.0]), "x=0 on a log axis"),
    (lambda c: c["series"][0]["spread"].pop(), "one \\[low, high\\] per point"),
    (lambda c: c["series"][0]["spread"].__setitem__(0, [9.0, 1.0]), "is not \\[low, high\\]"),
    (lambda c: c.update(curve="../escape"), "not a plain file stem"),
    (lambda c: c["derived"][0].pop("name"), "string 'name'"),
])
def test_a_bad_curve_is_named_with_its_field(change: Any, message: str) -> None:
    plot = _plotter()
    bad = copy.deepcopy(SAMPLE)
    change(bad)
    with pytest.raises(plot.CurveError, match=message):
        plot.validate(bad, "bad.json")


def test_negative_derived_values_are_fine_on_a_log_x_axis() -> None:
    plot = _plotter()
    assert plot.validate(copy.deepcopy(SAMPLE))["derived"][0]["points"][1][1] == -1.3


def test_every_committed_curve_file_is_valid() -> None:
    plot = _plotter()
    if not list((BENCH / "curves").glob("*.json")):
        pytest.skip("no bench/curves/*.json committed yet")
    for file, curve in plot.read_curves([BENCH / "curves"]):
        assert curve["curve"] == file.stem


@pytest.mark.ci_extra  # importing matplotlib and drawing: ~1-3 s on a 2-core machine
def test_a_png_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    plot = _plotter()
    out = plot.draw(copy.deepcopy(SAMPLE), tmp_path / "tiny_sample.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one_panel = {k: v for k, v in SAMPLE.items() if k != "derived"}
    assert plot.draw(one_panel, tmp_path / "one.png").stat().st_size > 1000

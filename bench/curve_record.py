"""The curve record the ``bench/curves_*.py`` scripts write (schema: bench/plot_curves.py).

:func:`paired` summarizes paired windows (median and quartiles of the differences);
:func:`record` builds one curve object with the run's facts (command, time, load, torch),
checks it with ``plot_curves.validate`` and :func:`write` puts it in ``bench/curves/``.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot_curves import validate

CURVES = Path(__file__).resolve().parent / "curves"


def quartiles(values: list[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles (the value twice when there is one)."""
    if len(values) < 2:
        return (values[0], values[0])
    q = statistics.quantiles(values, n=4)
    return (q[0], q[2])


def paired(raw: list[float], other: list[float]) -> dict[str, Any]:
    """Medians of each and of the paired differences ``other - raw``, with their IQR."""
    diffs = [o - r for o, r in zip(other, raw, strict=True)]
    pct = [100.0 * d / r for d, r in zip(diffs, raw, strict=True)]
    return {"raw": statistics.median(raw), "other": statistics.median(other),
            "diff": statistics.median(diffs), "diff_iqr": quartiles(diffs),
            "pct": statistics.median(pct), "pct_iqr": quartiles(pct),
            "raw_iqr": quartiles(raw), "other_iqr": quartiles(other)}


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages as ``/proc/loadavg`` gives them; ``"unknown"``."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def command_line() -> str:
    """The command that ran this bench, as typed from the repository root."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def record(curve: str, title: str, x: tuple[str, str], y: tuple[str, str],
           series: list[dict[str, Any]], derived: list[dict[str, Any]] | None = None,
           **extra: Any) -> dict[str, Any]:
    """One curve object, validated; ``extra`` adds bench-specific fields (kept by the plotter)."""
    import torch

    obj: dict[str, Any] = {
        "curve": curve, "title": title,
        "x": {"label": x[0], "scale": x[1]}, "y": {"label": y[0], "scale": y[1]},
        "series": series,
    }
    if derived:
        obj["derived"] = derived
    obj.update({
        "command": command_line(),
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
        "load_average": " ".join(f"{v:.1f}" for v in os.getloadavg()),
        "torch": torch.__version__,
        **extra,
    })
    return validate(obj, curve)


def write(curves: list[dict[str, Any]], json_dir: str | None) -> None:
    """Print every curve as JSON and write each to ``<json_dir>/<curve>.json``
    (default bench/curves; ``-`` prints only)."""
    print(json.dumps(curves, indent=1))
    if json_dir == "-":
        return
    where = Path(json_dir) if json_dir else CURVES
    where.mkdir(parents=True, exist_ok=True)
    for obj in curves:
        (where / f"{obj['curve']}.json").write_text(json.dumps(obj, indent=1) + "\n")

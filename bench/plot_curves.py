"""One small PNG per cost curve: reads bench/curves/*.json, writes bench/plots/<curve>.png.

Each JSON file holds one curve (the schema every ``bench/curves_*.py`` writes):
``curve`` (the file stem), ``title``, ``x``/``y`` (``label``, ``scale`` "log" | "linear"),
``series`` (``name``, ``points`` [[x, y], ...], optional ``spread`` [[low, high], ...] per
point), optional ``derived`` (the same shape: drawn in a second panel), ``command``, ``when``,
``load_average``, ``torch``; optional ``derived_label`` (the second panel's axis label). A
series ``raw X`` (any first word) beside ``accel X`` is drawn dashed in its colour. A file
that does not follow the schema is an error naming the file and the field, and nothing is
drawn for it.

Drawing needs matplotlib (the ``bench`` extra: ``pip install 'accel[bench]'``); reading and
checking the files does not (``--check`` only reads and checks them).

Usage:
    python bench/plot_curves.py                       # every bench/curves/*.json
    python bench/plot_curves.py bench/curves/gather_for_metrics.json --out bench/plots
    python bench/plot_curves.py --check               # validate only, no matplotlib needed
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCALES = ("log", "linear")
REQUIRED = ("curve", "title", "x", "y", "series", "command")


class CurveError(ValueError):
    """A curve file that does not follow the schema (the message names the file and field)."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_points(where: str, entry: Any, scale_x: str, scale_y: str | None) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise CurveError(f"{where}: each entry needs a string 'name', got {entry!r:.80}")
    points = entry.get("points")
    if not isinstance(points, list) or not points:
        raise CurveError(f"{where} {entry['name']!r}: 'points' must be a non-empty list of [x, y]")
    for point in points:
        if (not isinstance(point, list | tuple) or len(point) != 2
                or not all(_number(v) for v in point)):
            raise CurveError(f"{where} {entry['name']!r}: point {point!r} is not [x, y] numbers")
        if scale_x == "log" and point[0] <= 0:
            raise CurveError(f"{where} {entry['name']!r}: x={point[0]} on a log axis")
        if scale_y == "log" and point[1] <= 0:
            raise CurveError(f"{where} {entry['name']!r}: y={point[1]} on a log axis")
    spread = entry.get("spread")
    if spread is not None:
        if not isinstance(spread, list) or len(spread) != len(points):
            raise CurveError(f"{where} {entry['name']!r}: 'spread' needs one [low, high] per point")
        for pair in spread:
            if (not isinstance(pair, list | tuple) or len(pair) != 2
                    or not all(_number(v) for v in pair) or pair[0] > pair[1]):
                raise CurveError(f"{where} {entry['name']!r}: spread {pair!r} is not [low, high]")


def validate(curve: Any, source: str = "<curve>") -> dict[str, Any]:
    """Check one curve object against the schema; return it.

    Raises:
        CurveError: a missing or ill-typed field, named with ``source``.

    Example:
        >>> validate({"curve": "c", "title": "t", "x": {"label": "n", "scale": "log"},
        ...           "y": {"label": "s", "scale": "linear"}, "command": "python b.py",
        ...           "series": [{"name": "accel", "points": [[1, 2.0]]}]})["curve"]
        'c'
    """
    if not isinstance(curve, dict):
        raise CurveError(f"{source}: a curve is a JSON object, got {type(curve).__name__}")
    missing = [key for key in REQUIRED if key not in curve]
    if missing:
        raise CurveError(f"{source}: missing field(s) {missing} (schema: {list(REQUIRED)})")
    for key in ("curve", "title", "command"):
        if not isinstance(curve[key], str) or not curve[key]:
            raise CurveError(f"{source}: {key!r} must be a non-empty string")
    if not curve["curve"].replace("_", "").replace("-", "").isalnum():
        raise CurveError(f"{source}: 'curve' {curve['curve']!r} is not a plain file stem")
    scales = {}
    for axis in ("x", "y"):
        spec = curve[axis]
        if not isinstance(spec, dict) or not isinstance(spec.get("label"), str):
            raise CurveError(f"{source}: {axis!r} must be {{'label': str, 'scale': ...}}")
        if spec.get("scale", "linear") not in SCALES:
            raise CurveError(f"{source}: {axis}.scale {spec.get('scale')!r} is not one of {SCALES}")
        scales[axis] = spec.get("scale", "linear")
    if not isinstance(curve["series"], list) or not curve["series"]:
        raise CurveError(f"{source}: 'series' must be a non-empty list")
    for entry in curve["series"]:
        _check_points(f"{source}: series", entry, scales["x"], scales["y"])
    derived = curve.get("derived", [])
    if not isinstance(derived, list):
        raise CurveError(f"{source}: 'derived' must be a list")
    for entry in derived:
        _check_points(f"{source}: derived", entry, scales["x"], None)
    return curve


def read_curves(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """Each file read and validated (directories: their ``*.json``), in name order.

    Raises:
        CurveError: a file that is not JSON or not a curve; its stem differs from ``curve``.

    Example:
        >>> [c["curve"] for _, c in read_curves([Path("bench/curves")])][:1]
        ['checkpoint_ranks']
    """
    files: list[Path] = []
    for path in paths:
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    found = []
    for file in files:
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CurveError(f"{file}: not readable as JSON ({exc})") from None
        curve = validate(data, str(file))
        if curve["curve"] != file.stem:
            raise CurveError(f"{file}: 'curve' is {curve['curve']!r}, the file stem {file.stem!r}")
        found.append((file, curve))
    return found


def _footnote(curve: dict[str, Any]) -> str:
    bits = [curve["command"]]
    extra = [f"{k} {curve[k]}" for k in ("when", "load_average", "torch") if curve.get(k)]
    if extra:
        bits.append(", ".join(extra))
    return "\n".join(bits)


def _pairing(entries: list[dict[str, Any]]) -> dict[str, str]:
    """``raw X`` (any first word) drawn dashed in the colour of ``accel X``: a pair reads as one."""
    names = {e["name"] for e in entries}
    pairs = {}
    for name in names:
        head, _, rest = name.partition(" ")
        if head != "accel" and rest and f"accel {rest}" in names:
            pairs[name] = f"accel {rest}"
    return pairs


def _plot_entries(ax: Any, entries: list[dict[str, Any]]) -> None:
    pairs = _pairing(entries)
    colours: dict[str, Any] = {}
    order = [e for e in entries if e["name"] not in pairs] + [
        e for e in entries if e["name"] in pairs]
    for entry in order:
        xs = [p[0] for p in entry["points"]]
        ys = [p[1] for p in entry["points"]]
        spread = entry.get("spread")
        style: dict[str, Any] = {"marker": "o", "markersize": 4, "label": entry["name"],
                                 "linewidth": 1.2}
        if entry["name"] in pairs:
            style.update(color=colours.get(pairs[entry["name"]]), linestyle="--", marker="s")
        if spread:
            low = [max(y - s[0], 0.0) for y, s in zip(ys, spread, strict=True)]
            high = [max(s[1] - y, 0.0) for y, s in zip(ys, spread, strict=True)]
            line = ax.errorbar(xs, ys, yerr=[low, high], capsize=3, **style)[0]
        else:
            line = ax.plot(xs, ys, **style)[0]
        colours[entry["name"]] = line.get_color()
    handles, labels = ax.get_legend_handles_labels()
    rank = {e["name"]: i for i, e in enumerate(entries)}
    ordered = sorted(zip(handles, labels, strict=True), key=lambda hl: rank.get(hl[1], 0))
    ax.legend([h for h, _ in ordered], [lab for _, lab in ordered], fontsize=7)


def _x_ticks(ax: Any, curve: dict[str, Any]) -> None:
    """Few x points: ticks at the points themselves, written plainly (1, 2, 4; 0.1, 1.6)."""
    xs = sorted({p[0] for e in curve["series"] for p in e["points"]})
    if len(xs) <= 8:
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.minorticks_off()


def draw(curve: dict[str, Any], out: Path) -> Path:
    """Draw one curve into ``out`` (~600x400 px): series (spread as error bars), derived in a
    second panel, the title, and the command as a footnote.

    Example:
        >>> draw(curve, Path("bench/plots/gather_for_metrics.png"))
        PosixPath('bench/plots/gather_for_metrics.png')
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    derived = curve.get("derived") or []
    rows = 2 if derived else 1
    fig, axes = plt.subplots(rows, 1, figsize=(6.4, 4.6 if derived else 4.0), dpi=100,
                             sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4] if derived else [1]})
    main = axes[0][0]
    _plot_entries(main, curve["series"])
    main.set_xscale(curve["x"].get("scale", "linear"))
    main.set_yscale(curve["y"].get("scale", "linear"))
    main.set_ylabel(curve["y"]["label"], fontsize=8)
    main.set_title(curve["title"], fontsize=9)
    main.grid(True, which="both", alpha=0.3)
    main.tick_params(labelsize=7)
    if derived:
        second = axes[1][0]
        _plot_entries(second, derived)
        label = curve.get("derived_label") or (derived[0]["name"] if len(derived) == 1
                                               else "derived")
        second.set_ylabel(label, fontsize=8)
        second.grid(True, which="both", alpha=0.3)
        second.tick_params(labelsize=7)
        if len(derived) == 1:
            second.get_legend().remove()
        second.axhline(1.0 if "ratio" in derived[0]["name"] else 0.0, color="grey",
                       linewidth=0.6)  # a ratio's parity, a difference's zero
    axes[-1][0].set_xlabel(curve["x"]["label"], fontsize=8)
    for row in axes:
        _x_ticks(row[0], curve)
    fig.text(0.01, 0.005, _footnote(curve), fontsize=5.5, color="dimgray", va="bottom",
             family="monospace", wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, default=[HERE / "curves"],
                        help="curve files or directories (default bench/curves)")
    parser.add_argument("--out", type=Path, default=HERE / "plots",
                        help="where the PNGs go (default bench/plots)")
    parser.add_argument("--check", action="store_true", help="read and validate only")
    args = parser.parse_args(argv)
    try:
        curves = read_curves(args.paths)
    except CurveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for file, curve in curves:
        if args.check:
            print(f"ok {file}")
        else:
            print(draw(curve, args.out / f"{curve['curve']}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

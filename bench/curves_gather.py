"""``accel.gather_for_metrics`` against a raw all_gather, for 1, 2 and 4 ranks; curve JSON.

On each world size of ``--ranks`` (gloo CPU processes, ``accel.testing.run_distributed``)
and each tensor of ``--rows`` x 16 fp32 per rank (one batch of per-sample outputs):

- accel: ``accel.gather_for_metrics(t)`` (outside a loader's last batch: a plain gather;
  on one process nothing is gathered and ``t`` comes back);
- raw: the same gather by hand, ``out = t.new_empty(...)``; ``dist.all_gather_single(out, t)``
  (torch's single-tensor all_gather; on one process a copy).

Both in alternating windows of ``--calls`` calls in the same processes (the slowest rank's
time per call); per point: the medians and the median of the paired differences (accel -
raw) with its interquartile range.

Curve written (``--json-out DIR``, default bench/curves; ``-`` prints only):
``gather_for_metrics`` (time per call vs ranks, one accel and one raw series per size;
overhead per call derived).

Usage:
    python bench/curves_gather.py                                   # full quality (~1 min)
    python bench/curves_gather.py --ranks 1 2 --rows 8 --windows 2 --calls 5 --json-out -
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import paired, record, write

import accel
from accel.testing import run_distributed

COLS = 16


def _raw(t: torch.Tensor) -> torch.Tensor:
    out = t.new_empty((dist.get_world_size() * t.shape[0], *t.shape[1:]))
    dist.all_gather_single(out, t)
    return out


def measure(rows: list[int], windows: int, calls: int) -> dict[str, Any]:
    """Paired windows of accel's and the raw gather, per size (every rank)."""
    torch.set_num_threads(1)
    found = {}
    for n in rows:
        t = torch.full((n, COLS), float(dist.get_rank()))
        want = _raw(t)
        got = accel.gather_for_metrics(t)
        assert torch.equal(got, want), "gather_for_metrics differs from the raw gather"

        def window(fn: Any, t: torch.Tensor = t) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn(t)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            return float(took.item()) / calls

        raw, acc = [], []
        for w in range(windows):
            for which in ((0, 1) if w % 2 == 0 else (1, 0)):
                if which == 0:
                    raw.append(window(_raw))
                else:
                    acc.append(window(accel.gather_for_metrics))
        found[n] = {"raw_s": raw, "accel_s": acc}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 4096, 65536])
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json-out", default=None,
                        help="directory for the curve files (default bench/curves; - prints only)")
    args = parser.parse_args()
    by_size: dict[int, list[dict[str, Any]]] = {n: [] for n in args.rows}
    for world in args.ranks:
        out = run_distributed(measure, args.rows, args.windows, args.calls, world_size=world,
                              timeout=1800)[0]
        for n in args.rows:
            by_size[n].append({"ranks": world, **paired(out[n]["raw_s"], out[n]["accel_s"])})
    us = 1e6

    def label(n: int) -> str:
        size = n * COLS * 4
        if size < 1 << 10:
            return f"{size} B"
        return f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"

    series, derived = [], []
    for n, points in by_size.items():
        series.append({"name": f"accel {label(n)}/rank",
                       "points": [[p["ranks"], p["other"] * us] for p in points],
                       "spread": [[q * us for q in p["other_iqr"]] for p in points]})
        series.append({"name": f"raw {label(n)}/rank",
                       "points": [[p["ranks"], p["raw"] * us] for p in points],
                       "spread": [[q * us for q in p["raw_iqr"]] for p in points]})
        derived.append({"name": f"overhead us {label(n)}",
                        "points": [[p["ranks"], round(p["diff"] * us, 2)] for p in points],
                        "spread": [[round(q * us, 2) for q in p["diff_iqr"]] for p in points]})
    curve = record(
        "gather_for_metrics", "gather_for_metrics vs raw all_gather (gloo), per call",
        ("ranks", "log"), ("us per call", "log"), series, derived,
        points=[{"rows": n, "bytes_per_rank": n * COLS * 4, "ranks": p["ranks"],
                 "raw_us": round(p["raw"] * us, 2), "accel_us": round(p["other"] * us, 2),
                 "overhead_us": round(p["diff"] * us, 2),
                 "overhead_us_iqr": [round(q * us, 2) for q in p["diff_iqr"]]}
                for n, points in by_size.items() for p in points],
        derived_label="accel - raw, us per call",
        setup={"cols": COLS, "windows": args.windows, "calls": args.calls},
    )
    write([curve], args.json_out)


if __name__ == "__main__":
    main()

"""Per-step overhead of accel over hand-written PyTorch / DDP; prints JSON.

The quicktour model (Linear 10->5, batch 100, SGD, MSE) is set up twice in the same process:
raw (plain module, or DistributedDataParallel under several processes, with ``no_sync`` for
accumulation written by hand) and through accel (``prepare`` + ``accumulate`` + ``backward``).
Both are timed in alternating windows so machine drift hits both; the report gives per-step
microseconds (median over windows) and the median of the paired differences.

Usage:
    python bench/step_overhead.py                 # 1 process and 2 processes
    python bench/step_overhead.py --procs 1 --windows 40 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import accel
from accel.testing import run_distributed


def _raw_loop(model: nn.Module, opt: torch.optim.Optimizer, data: Any, steps: int,
              accumulation: int) -> float:
    xs, ys = data
    loss_fn = nn.MSELoss()
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    start = time.perf_counter()
    for i in range(steps):
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        sync = (i + 1) % accumulation == 0
        if is_ddp and not sync:
            with model.no_sync():  # type: ignore[operator]
                loss = loss_fn(model(x), y) / accumulation
                loss.backward()
        else:
            loss = loss_fn(model(x), y)
            if accumulation > 1:
                loss = loss / accumulation
            loss.backward()
        if sync:
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - start


def _accel_loop(model: nn.Module, opt: Any, data: Any, steps: int) -> float:
    xs, ys = data
    loss_fn = nn.MSELoss()
    start = time.perf_counter()
    for i in range(steps):
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        with accel.accumulate(model):
            loss = loss_fn(model(x), y)
            accel.backward(loss)
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - start


def measure(windows: int, steps: int, accumulation: int) -> dict[str, Any]:
    """Time raw and accel loops in alternating windows (call on every rank)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    st = accel.state()
    data = (torch.randn(16, 100, 10), torch.randn(16, 100, 5))
    raw_model: nn.Module = nn.Linear(10, 5)
    if st.world_size > 1:
        raw_model = nn.parallel.DistributedDataParallel(raw_model)
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    with accel.distributed(gradient_accumulation_steps=accumulation):
        model = accel.prepare_model(nn.Linear(10, 5))
        opt = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        _raw_loop(raw_model, raw_opt, data, steps, accumulation)  # warm up both
        _accel_loop(model, opt, data, steps)
        raw, acc = [], []
        for w in range(windows):
            order = (0, 1) if w % 2 == 0 else (1, 0)
            for which in order:
                if which == 0:
                    raw.append(_raw_loop(raw_model, raw_opt, data, steps, accumulation) / steps)
                else:
                    acc.append(_accel_loop(model, opt, data, steps) / steps)
    diffs = [a - r for a, r in zip(acc, raw, strict=True)]
    return {
        "raw_us": round(statistics.median(raw) * 1e6, 2),
        "accel_us": round(statistics.median(acc) * 1e6, 2),
        "overhead_us": round(statistics.median(diffs) * 1e6, 2),
        "overhead_us_p25_p75": [round(q * 1e6, 2) for q in statistics.quantiles(diffs, n=4)[::2]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--procs", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    report: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                              "windows": args.windows, "steps_per_window": args.steps}
    for procs in args.procs:
        for accumulation in (1, 4):
            key = f"procs={procs},accumulation={accumulation}"
            if procs == 1:
                report[key] = measure(args.windows, args.steps, accumulation)
            else:
                results = run_distributed(measure, args.windows, args.steps, accumulation,
                                          world_size=procs, timeout=1800)
                report[key] = results[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

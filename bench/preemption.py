"""Per-step cost of ``accel.stop_requested()`` when no signal arrives; prints JSON.

The same loop runs with and without a ``stop_requested()`` call per step, in alternating windows
in the same processes (so machine drift hits both); the report gives per-step microseconds
(median over windows) and the median of the paired differences. Two loops:

- ``quicktour``: the quicktour step (Linear 10->5, batch 100, SGD, MSE; DDP on several
  processes): the cost in a (tiny) real training step.
- ``matmul``: a 64x64 matrix product (tens of microseconds), no communication: a short step
  whose timing does not depend on the other process.
- ``empty``: nothing but the call: the worst case, where the agreement all-reduce has the least
  time to complete in the background.

Usage:
    python bench/preemption.py                 # 1 process and 2 processes
    python bench/preemption.py --procs 2 --windows 40 --steps 500
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import accel
from accel.testing import run_distributed


def _quicktour_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> Callable[[], None]:
    loss_fn = nn.MSELoss()

    def step() -> None:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _window(step: Callable[[], None], steps: int, check: bool) -> float:
    stop = accel.stop_requested
    start = time.perf_counter()
    if check:
        for _ in range(steps):
            step()
            if stop():
                raise RuntimeError("stop_requested() returned True without a signal")
    else:
        for _ in range(steps):
            step()
    return (time.perf_counter() - start) / steps


def measure(windows: int, steps: int) -> dict[str, Any]:
    """Time both loops with and without the call (call on every rank inside the block)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = accel.prepare_model(nn.Linear(10, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = torch.randn(64, 64)
    loops: dict[str, Callable[[], None]] = {
        "quicktour": _quicktour_step(model, opt, torch.randn(100, 10), torch.randn(100, 5)),
        "matmul": lambda: torch.mm(a, a),
        "empty": lambda: None,
    }
    report: dict[str, Any] = {}
    for name, step in loops.items():
        _window(step, steps, False)  # warm up both
        _window(step, steps, True)
        plain, checked = [], []
        for w in range(windows):
            for check in ((False, True) if w % 2 == 0 else (True, False)):
                (checked if check else plain).append(_window(step, steps, check))
        diffs = [c - p for c, p in zip(checked, plain, strict=True)]
        report[name] = {
            "step_us": round(statistics.median(plain) * 1e6, 2),
            "with_stop_requested_us": round(statistics.median(checked) * 1e6, 2),
            "cost_per_call_us": round(statistics.median(diffs) * 1e6, 2),
            "cost_us_p25_p75": [round(q * 1e6, 2) for q in statistics.quantiles(diffs, n=4)[::2]],
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--procs", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    report: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                              "windows": args.windows, "steps_per_window": args.steps,
                              "goal": "cost_per_call_us <= 5 on 2 gloo processes"}
    for procs in args.procs:
        key = f"procs={procs}"
        if procs == 1:
            with accel.distributed(cpu=True):
                report[key] = measure(args.windows, args.steps)
        else:
            report[key] = run_distributed(measure, args.windows, args.steps,
                                          world_size=procs, timeout=1800)[0]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

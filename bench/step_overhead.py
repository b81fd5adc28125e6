"""Per-step overhead of accel over hand-written PyTorch / DDP; prints JSON.

The quicktour model (Linear 10->5, batch 100, SGD, MSE) is set up twice in the same process:
raw (plain module, or DistributedDataParallel under several processes, with ``no_sync`` for
accumulation written by hand) and through accel (``prepare`` + ``accumulate`` + ``backward``).
Both are timed in alternating windows so machine drift hits both; the report gives per-step
microseconds (median over windows) and the median of the paired differences.

``--mixed-precision no bf16 fp16`` measures each policy in the same run (the issue 23 check:
bf16/fp16 overhead against the fp32 one). Under bf16/fp16 the raw loop runs its forward under
``torch.autocast`` by hand and keeps the outputs as they come (``--raw-fp32-outputs`` makes it
call ``.float()`` on them, as accel's prepared forward does by default); under fp16 the raw
loop scales the loss with its own ``torch.amp.GradScaler`` (``scale``/``step``/``update``).

Usage:
    python bench/step_overhead.py                 # 1 process and 2 processes
    python bench/step_overhead.py --procs 1 --windows 40 --steps 200
    python bench/step_overhead.py --procs 1 --accumulation 1 --mixed-precision no bf16 fp16 \
        --clock cpu --windows 60 --steps 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import accel
from accel.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import loadavg

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_clock = time.perf_counter  # --clock cpu: time.thread_time (CPU time of this thread)


class _Raw:
    """What the raw loop does by hand under a mixed precision policy."""

    def __init__(self, mixed_precision: str, fp32_outputs: bool) -> None:
        self.dtype = _DTYPES.get(mixed_precision)
        self.fp32_outputs = fp32_outputs
        self.scaler = torch.amp.GradScaler("cpu") if mixed_precision == "fp16" else None

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:
            out: torch.Tensor = model(x)
            return out
        with torch.autocast("cpu", dtype=self.dtype):
            out = model(x)
        return out.float() if self.fp32_outputs else out

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()  # type: ignore[no-untyped-call]

    def step(self, opt: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            opt.step()
        else:
            self.scaler.step(opt)
            self.scaler.update()


def _raw_loop(model: nn.Module, opt: torch.optim.Optimizer, data: Any, steps: int,
              accumulation: int, raw: _Raw) -> float:
    xs, ys = data
    loss_fn = nn.MSELoss()
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    start = _clock()
    for i in range(steps):
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        sync = (i + 1) % accumulation == 0
        if is_ddp and not sync:
            with model.no_sync():  # type: ignore[operator]
                loss = loss_fn(raw.forward(model, x), y) / accumulation
                raw.backward(loss)
        else:
            loss = loss_fn(raw.forward(model, x), y)
            if accumulation > 1:
                loss = loss / accumulation
            raw.backward(loss)
        if sync:
            raw.step(opt)
            opt.zero_grad()
    return _clock() - start


def _accel_loop(model: nn.Module, opt: Any, data: Any, steps: int) -> float:
    xs, ys = data
    loss_fn = nn.MSELoss()
    start = _clock()
    for i in range(steps):
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        with accel.accumulate(model):
            loss = loss_fn(model(x), y)
            accel.backward(loss)
            opt.step()
            opt.zero_grad()
    return _clock() - start


def measure(windows: int, steps: int, accumulation: int, mixed_precision: str = "no",
            raw_fp32_outputs: bool = False, clock: str = "wall") -> dict[str, Any]:
    """Time raw and accel loops in alternating windows (call on every rank)."""
    global _clock
    _clock = time.thread_time if clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    torch.set_num_threads(1)
    st = accel.state()
    data = (torch.randn(16, 100, 10), torch.randn(16, 100, 5))
    raw_model: nn.Module = nn.Linear(10, 5)
    if st.world_size > 1:
        raw_model = nn.parallel.DistributedDataParallel(raw_model)
    raw_opt = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    by_hand = _Raw(mixed_precision, raw_fp32_outputs)
    with accel.distributed(gradient_accumulation_steps=accumulation,
                           mixed_precision=mixed_precision):
        model = accel.prepare_model(nn.Linear(10, 5))
        opt = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        _raw_loop(raw_model, raw_opt, data, steps, accumulation, by_hand)  # warm up both
        _accel_loop(model, opt, data, steps)
        raw, acc = [], []
        for w in range(windows):
            order = (0, 1) if w % 2 == 0 else (1, 0)
            for which in order:
                if which == 0:
                    seconds = _raw_loop(raw_model, raw_opt, data, steps, accumulation, by_hand)
                    raw.append(seconds / steps)
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
    parser.add_argument("--accumulation", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--mixed-precision", nargs="*", default=["no"],
                        choices=["no", "bf16", "fp16"],
                        help="policies to measure, each in turn in the same run")
    parser.add_argument("--raw-fp32-outputs", action="store_true",
                        help="the raw loop casts its autocast outputs to fp32 by hand")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: time.thread_time, the CPU time the loop itself used (on a "
                             "machine loaded by others, waits for a core do not count)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the policy sweep, interleaved; the report keeps each "
                             "policy's lowest overhead (best of rounds)")
    args = parser.parse_args()
    report: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                              "windows": args.windows, "steps_per_window": args.steps,
                              "raw_fp32_outputs": args.raw_fp32_outputs, "clock": args.clock,
                              "loadavg": loadavg()}
    for procs in args.procs:
        for accumulation in args.accumulation:
            for _ in range(args.rounds):
                for policy in args.mixed_precision:
                    key = f"procs={procs},accumulation={accumulation}"
                    if policy != "no" or len(args.mixed_precision) > 1:
                        key += f",mixed_precision={policy}"
                    call = (args.windows, args.steps, accumulation, policy,
                            args.raw_fp32_outputs, args.clock)
                    if procs == 1:
                        result = measure(*call)
                    else:
                        result = run_distributed(measure, *call, world_size=procs,
                                                 timeout=1800)[0]
                    old = report.get(key)
                    if old is None or result["overhead_us"] < old["overhead_us"]:
                        report[key] = result
    report["loadavg_after"] = loadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Step time vs number of parameter tensors: accel against the raw loop; curve JSON (issue 43).

Model for N parameter tensors: N/2 ``Linear(--width, --width)`` layers (weight and bias each)
in ``min(4, N/2)`` blocks (``Block``, an ``nn.Sequential`` of the layers, held in an
``nn.ModuleList``), batch ``--batch`` rows per rank, MSE against a fixed target, plain SGD
(torch's default per-tensor loop on CPU). Widths stay small so that per-tensor costs (Python
and dispatch), not arithmetic, make up the step: the quantity issue 43 asks about.

Settings (``--settings``), each against its yardstick in the same processes:

- ``1proc``: one process. The raw loop and the accel loop drive the *same* module and
  optimizer objects (``prepare_model`` returns the module itself on one process), so memory
  layout cannot favour either: the difference is accel's calls alone.
- ``ddp2``: 2 gloo processes; raw ``DistributedDataParallel`` (``no_sync`` by hand when
  accumulating) against ``accel.distributed(strategy="ddp")`` + ``prepare_model``.
- ``fsdp2``: 2 gloo processes; raw ``fully_shard`` on each block and the root, with
  ``set_requires_gradient_sync(sync)`` before each batch when accumulating, against
  ``strategy="fsdp"`` + ``prepare_model(shard_modules=Block)`` (the same sharding).

accel's loop: ``with accel.accumulate(model): accel.backward(loss); opt.step();
opt.zero_grad()`` with a prepared optimizer; the raw loop divides the loss by the accumulation
steps and steps on sync steps. Both bind the loss to a name (``loss = ...``) and keep it to the
next step: passing it as a temporary (``backward(loss_fn(...))``) frees its autograd graph at
another point of the step, which costs raw torch itself +13 us at 40 tensors and +142 us at 400
on this machine (an A/A run of the raw loop both ways), and was billed to accel before.
Both run in alternating windows of whole accumulation cycles
(steps per window chosen so a raw window takes about ``--window-ms``; ``--windows`` pairs, fewer
where they would take over ``--point-s``, not below ``--min-windows``: FSDP2 at 4,000 tensors
takes ~1 s a step on the 2-core machine); a window's time is the slowest rank's. Per point:
the medians per step, the median of the paired differences (accel - raw) with its
interquartile range, and that in % of the raw step. Goal: <= +10 us + 0.5 % at every size.

Load-independent evidence (``--calls-max-tensors``, default 400): Python and builtin calls
per step of each loop counted with ``sys.setprofile`` over one accumulation cycle; the
curve's ``accel_added_calls_per_step`` is accel's minus raw's (flat = accel does no
per-tensor Python work per step).

Curves written (``--json-out DIR``, default bench/curves; ``-`` prints only):
``step_overhead_{1proc,ddp2,fsdp2}`` and ``..._acc4`` for ``--accumulation 4``.

Usage:
    python bench/curves_step.py                                   # full quality (~5 min)
    python bench/curves_step.py --tensors 2 40 --windows 2 --window-ms 5 --json-out -  # smoke
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import paired, quartiles, record, write

import accel
from accel.testing import run_distributed

YARDSTICK = {"1proc": "raw loop", "ddp2": "raw DDP", "fsdp2": "raw fully_shard"}
STRATEGY = {"1proc": "none", "ddp2": "ddp", "fsdp2": "fsdp"}
TITLE = {"1proc": "one process", "ddp2": "DDP on 2 processes", "fsdp2": "FSDP2 on 2 processes"}


class Block(nn.Sequential):
    """A run of ``Linear(width, width)`` layers: FSDP2's unit of sharding here."""


class Net(nn.Module):
    """``tensors / 2`` Linear layers in ``min(4, tensors / 2)`` blocks."""

    def __init__(self, tensors: int, width: int) -> None:
        super().__init__()
        layers = max(1, tensors // 2)
        blocks = min(4, layers)
        sizes = [layers // blocks + (1 if b < layers % blocks else 0) for b in range(blocks)]
        self.blocks = nn.ModuleList(
            Block(*[nn.Linear(width, width) for _ in range(size)]) for size in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_net(tensors: int, width: int) -> Net:
    torch.manual_seed(0)
    return Net(tensors, width)


def raw_fully_shard(model: Net) -> Net:
    """What a hand-written FSDP2 script does: ``fully_shard`` each block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _raw_loop(setting: str, model: Any, opt: Any, data: Any, accumulation: int
              ) -> Callable[[int], float]:
    x, y = data
    loss_fn = nn.MSELoss()

    def run(steps: int) -> float:
        start = time.perf_counter()
        for i in range(steps):
            sync = (i + 1) % accumulation == 0
            if setting == "fsdp2" and accumulation > 1:
                model.set_requires_gradient_sync(sync)
            off = setting == "ddp2" and not sync
            with model.no_sync() if off else contextlib.nullcontext():
                loss = loss_fn(model(x), y)
                if accumulation > 1:
                    loss = loss / accumulation
                loss.backward()
            if sync:
                opt.step()
                opt.zero_grad()
        return time.perf_counter() - start

    return run


def _accel_loop(model: nn.Module, opt: Any, data: Any) -> Callable[[int], float]:
    x, y = data
    loss_fn = nn.MSELoss()

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            with accel.accumulate(model):
                loss = loss_fn(model(x), y)  # bound as in the raw loop: see the docstring
                accel.backward(loss)
                opt.step()
                opt.zero_grad()
        return time.perf_counter() - start

    return run


def _slowest(seconds: float) -> float:
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _calls(run: Callable[[int], float], steps: int) -> float:
    """Python + builtin calls per step (``sys.setprofile``): independent of machine load."""
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        counts[event] += 1

    sys.setprofile(profile)
    try:
        run(steps)
    finally:
        sys.setprofile(None)
    return (counts["call"] + counts["c_call"]) / steps


def _objects(setting: str, tensors: int, width: int) -> tuple[Any, Any, nn.Module, Any]:
    """(raw model, raw optimizer, accel model, accel optimizer); call inside distributed()."""
    if setting == "1proc":  # the same objects: prepare_model returns the module itself
        model = accel.prepare_model(make_net(tensors, width))
        opt = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
        return model, opt.optimizer, model, opt
    raw: Any = make_net(tensors, width)
    raw = nn.parallel.DistributedDataParallel(raw) if setting == "ddp2" else raw_fully_shard(raw)
    raw_opt = torch.optim.SGD(raw.parameters(), lr=1e-3)
    options = {"shard_modules": Block} if setting == "fsdp2" else {}
    model = accel.prepare_model(make_net(tensors, width), **options)
    opt = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    return raw, raw_opt, model, opt


def measure_point(setting: str, tensors: int, accumulation: int, args: Any) -> dict[str, Any]:
    """Paired windows of the raw and the accel loop at one size (every rank)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(1 + rank)
    data = (torch.randn(args.batch, args.width, generator=generator),
            torch.randn(args.batch, args.width, generator=generator))
    with accel.distributed(strategy=STRATEGY[setting],
                           gradient_accumulation_steps=accumulation):
        raw_model, raw_opt, model, opt = _objects(setting, tensors, args.width)
        raw_run = _raw_loop(setting, raw_model, raw_opt, data, accumulation)
        accel_run = _accel_loop(model, opt, data)
        cycle = accumulation
        raw_run(cycle)  # warm up both (FSDP2's lazy init, allocator)
        accel_run(cycle)
        per_step = _slowest(raw_run(cycle)) / cycle  # the same on every rank
        cycles = max(1, round(args.window_ms / 1000 / per_step / cycle))
        steps = cycles * cycle
        # a slow point (one window of several seconds) gets fewer windows: --point-s bounds it
        fit = int(args.point_s / (2 * steps * per_step))
        windows = min(args.windows, max(args.min_windows, fit))
        raw, acc = [], []
        for w in range(windows):
            for which in ((0, 1) if w % 2 == 0 else (1, 0)):
                _barrier()
                if which == 0:
                    raw.append(_slowest(raw_run(steps)) / steps)
                else:
                    acc.append(_slowest(accel_run(steps)) / steps)
        calls = None
        if tensors <= args.calls_max_tensors:
            calls = (_calls(raw_run, cycle), _calls(accel_run, cycle))
    return {"tensors": tensors, "steps_per_window": steps, "windows": windows, "raw": raw,
            "accel": acc, "calls": calls}


def measure_setting(setting: str, args: Any) -> list[dict[str, Any]]:
    """Every point of one setting, in one set of processes (every rank)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # a deep chain of small layers must not go subnormal
    return [measure_point(setting, tensors, accumulation, args)
            for accumulation in args.accumulation for tensors in args.tensors]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def curve_of(setting: str, accumulation: int, points: list[dict[str, Any]],
             args: Any) -> dict[str, Any]:
    """One curve object from a setting's points at one accumulation."""
    stats = [(p["tensors"], paired(p["raw"], p["accel"]), p) for p in points]
    name = f"step_overhead_{setting}" + ("" if accumulation == 1 else f"_acc{accumulation}")
    title = f"Step time vs parameter tensors, {TITLE[setting]}"
    if accumulation > 1:
        title += f", accumulation {accumulation}"

    def series(label: str, key: str, values: str) -> dict[str, Any]:
        return {"name": label,
                "points": [[n, _us(s[key])] for n, s, _ in stats],
                "spread": [[_us(v) for v in quartiles(p[values])] for _, _, p in stats]}

    added = [[n, round(p["calls"][1] - p["calls"][0], 2)] for n, _, p in stats if p["calls"]]
    return record(
        name, title, ("parameter tensors", "log"), ("us per step", "log"),
        [series("accel", "other", "accel"), series(YARDSTICK[setting], "raw", "raw")],
        [{"name": "overhead us", "points": [[n, _us(s["diff"])] for n, s, _ in stats],
          "spread": [[_us(v) for v in s["diff_iqr"]] for _, s, _ in stats]},
         {"name": "overhead %", "points": [[n, round(s["pct"], 3)] for n, s, _ in stats],
          "spread": [[round(v, 3) for v in s["pct_iqr"]] for _, s, _ in stats]}],
        model=f"N/2 Linear({args.width}, {args.width}) in min(4, N/2) blocks, batch "
              f"{args.batch} per rank, SGD, MSE",
        windows=[[n, p["windows"]] for n, _, p in stats],
        steps_per_window=[[n, p["steps_per_window"]] for n, _, p in stats],
        accel_added_calls_per_step=added,
        calls_per_step={"raw": [[n, p["calls"][0]] for n, _, p in stats if p["calls"]],
                        "accel": [[n, p["calls"][1]] for n, _, p in stats if p["calls"]]},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["1proc", "ddp2", "fsdp2"],
                        choices=list(STRATEGY))
    parser.add_argument("--tensors", type=int, nargs="+", default=[2, 40, 400, 4000])
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--window-ms", type=float, default=150.0,
                        help="about how long one raw window runs (whole accumulation cycles)")
    parser.add_argument("--point-s", type=float, default=10.0,
                        help="fewer windows (not below --min-windows) where the pairs would "
                             "take longer than this at one point")
    parser.add_argument("--min-windows", type=int, default=6)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--calls-max-tensors", type=int, default=400,
                        help="count calls per step at sizes up to this (profiling is slow)")
    parser.add_argument("--json-out", default=None,
                        help="directory for the curve files (default bench/curves; - prints only)")
    args = parser.parse_args()
    if any(n < 2 or n % 2 for n in args.tensors):
        parser.error("--tensors: even numbers >= 2 (weight and bias per layer)")
    curves = []
    for setting in args.settings:
        if setting == "1proc":
            points = measure_setting(setting, args)
        else:
            points = run_distributed(measure_setting, setting, args, world_size=2,
                                     timeout=3600)[0]
        for accumulation in args.accumulation:
            chosen = points[args.accumulation.index(accumulation) * len(args.tensors):]
            curves.append(curve_of(setting, accumulation, chosen[:len(args.tensors)], args))
    write(curves, args.json_out)
    for obj in curves:  # a short table on stderr
        overhead, pct = obj["derived"][0]["points"], obj["derived"][1]["points"]
        print(obj["curve"], [f"{n}: {o:+.1f} us ({p:+.2f}%)"
                             for (n, o), (_, p) in zip(overhead, pct, strict=True)],
              file=sys.stderr)


if __name__ == "__main__":
    main()

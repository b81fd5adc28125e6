"""prepare_model time vs number of parameter tensors against the raw engine's set-up; curve JSON.

The model is bench/curves_step.py's (N/2 ``Linear(--width, --width)`` in ``min(4, N/2)``
blocks). For each size, ``--repeat`` times, alternating which goes first, each on a freshly
built model (building it is not timed):

- ``1proc``: ``model.to(device)`` against ``accel.prepare_model(model)`` (one process:
  placement, the settings agreement is skipped, no wrapper);
- ``ddp2``: ``DistributedDataParallel(model.to(device))`` (the portable script's set-up)
  against ``prepare_model`` under ``strategy="ddp"`` (2 gloo processes; accel's agreement on
  the settings, one small ``all_gather``, included);
- ``fsdp2``: ``fully_shard`` on each block and the root (the mesh made once beforehand, as a
  script does) against ``prepare_model(shard_modules=Block)`` under ``strategy="fsdp"``.

The garbage collector runs before each timed call and is off during it (building thousands
of modules otherwise bills a full collection to whichever call comes next). Each time is the
slowest rank's, from a barrier to the end of the call; per point the medians
(with their IQR) and the ratio accel / raw of the medians (goal: <= 1.1).

Curves written (``--json-out DIR``, default bench/curves; ``-`` prints only):
``prepare_model_{1proc,ddp2,fsdp2}``.

Usage:
    python bench/curves_prepare.py                                  # full quality (~1 min)
    python bench/curves_prepare.py --tensors 2 40 --repeat 2 --json-out -    # smoke
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import quartiles, record, write
from curves_step import STRATEGY, TITLE, Block, make_net

import accel
from accel.testing import run_distributed

YARDSTICK = {"1proc": "model.to(device)", "ddp2": "raw DDP(model.to(device))",
             "fsdp2": "raw fully_shard"}


def _timed(function: Callable[[], Any]) -> float:
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    gc.disable()
    try:
        start = time.perf_counter()
        function()
        seconds = time.perf_counter() - start
    finally:
        gc.enable()
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _raw_setup(setting: str) -> Callable[[nn.Module], Any]:
    device = accel.state().device
    if setting == "1proc":
        return lambda model: model.to(device)
    if setting == "ddp2":
        return lambda model: nn.parallel.DistributedDataParallel(model.to(device))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def shard(model: Any) -> Any:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return shard


def measure_setting(setting: str, tensors_list: list[int], repeat: int, width: int
                    ) -> list[dict[str, Any]]:
    """Raw set-up and prepare_model times per size (every rank)."""
    torch.set_num_threads(1)
    options = {"shard_modules": Block} if setting == "fsdp2" else {}
    found = []
    with accel.distributed(strategy=STRATEGY[setting]):
        raw_setup = _raw_setup(setting)
        raw_setup(make_net(2, width))  # warm both (imports, the mesh, first collectives)
        accel.prepare_model(make_net(2, width), **options)
        for tensors in tensors_list:
            raw, acc = [], []
            for r in range(repeat):
                for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                    model = make_net(tensors, width)
                    if which == 0:
                        raw.append(_timed(lambda model=model: raw_setup(model)))
                    else:
                        acc.append(_timed(
                            lambda model=model: accel.prepare_model(model, **options)))
                    del model
            found.append({"tensors": tensors, "raw": raw, "accel": acc})
    return found


def curve_of(setting: str, points: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """One curve object from a setting's points."""
    def series(label: str, key: str) -> dict[str, Any]:
        return {"name": label,
                "points": [[p["tensors"], round(statistics.median(p[key]) * 1e3, 4)]
                           for p in points],
                "spread": [[round(v * 1e3, 4) for v in quartiles(p[key])] for p in points]}

    ratios = [[p["tensors"], round(statistics.median(p["accel"]) / statistics.median(p["raw"]), 3)]
              for p in points]
    return record(
        f"prepare_model_{setting}", f"prepare_model time vs parameter tensors, {TITLE[setting]}",
        ("parameter tensors", "log"), ("ms", "log"),
        [series("accel.prepare_model", "accel"), series(YARDSTICK[setting], "raw")],
        [{"name": "accel / raw", "points": ratios}],
        model=f"N/2 Linear({args.width}, {args.width}) in min(4, N/2) blocks",
        repeat=args.repeat,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["1proc", "ddp2", "fsdp2"],
                        choices=list(STRATEGY))
    parser.add_argument("--tensors", type=int, nargs="+", default=[2, 40, 400, 4000])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--json-out", default=None,
                        help="directory for the curve files (default bench/curves; - prints only)")
    args = parser.parse_args()
    if any(n < 2 or n % 2 for n in args.tensors):
        parser.error("--tensors: even numbers >= 2 (weight and bias per layer)")
    curves = []
    for setting in args.settings:
        call = (setting, args.tensors, args.repeat, args.width)
        if setting == "1proc":
            points = measure_setting(*call)
        else:
            points = run_distributed(measure_setting, *call, world_size=2, timeout=3600)[0]
        curves.append(curve_of(setting, points, args))
    write(curves, args.json_out)
    for obj in curves:  # a short table on stderr
        print(obj["curve"], [f"{n}: x{r}" for n, r in obj["derived"][0]["points"]],
              file=sys.stderr)


if __name__ == "__main__":
    main()

"""Tensor parallel x FSDP through accel vs the same raw-torch mesh loop; prints JSON.

Runs on ``--procs`` CPU processes over gloo (``accel.testing.run_distributed``), on a mesh of
``--tp`` x (procs / tp) (TP x FSDP). The same model (``--blocks`` residual MLP blocks of width
``--width`` and a head; the blocks' ``up``/``down`` split column-/row-wise over ``tp``, then
``fully_shard`` on each block and the root over the ``dp_shard`` dim), the same batches
(``--batch`` per data-parallel rank), AdamW (foreach), MSE, global gradient clipping:

- raw: ``init_device_mesh``, ``parallelize_module``, ``fully_shard`` by hand, and the loop
  ``loss.backward()``, a hand-written global norm over the gradients' meshes (torch's
  ``clip_grad_norm_`` refuses the mix of meshes a TP x FSDP model has) with
  ``clip_grads_with_norm_``, ``step``, ``zero_grad``;
- accel: ``accel.distributed(tp_size=, dp_shard_size=)``, ``prepare_model(tp_plan=...)``,
  ``prepare_optimizer``, and ``accel.backward``, ``accel.clip_grad_norm_``, ``step``,
  ``zero_grad``.

Both are timed in alternating windows of ``--steps`` steps (``raw_us``, ``accel_us``: the
slowest rank's window time per step, median over windows; ``overhead_us``: median of the
paired differences and its interquartile range). Goal: <= +25 us per step. On a loaded 2-core
machine running 4 processes, gloo's jitter is far larger than that, so two more figures
locate accel's own cost: ``clip_*_us``, the global-norm clip alone (the step's one
mesh-specific call: grouping gradients by mesh, a norm per group), accel's against the raw
loop's, in paired windows; and ``cprofile_own_us``, the own time per step of the functions
under ``accel/`` in the accel loop under cProfile (inflated by the profiler).

Usage:
    python bench/parallel.py                   # 4 processes, TP2 x FSDP2
    python bench/parallel.py --procs 2 --tp 2 --windows 6
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel
from accel.testing import run_distributed

PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def _raw_model(args: dict[str, Any], mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = Net(args["width"], args["blocks"])
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
    if mesh["dp_shard"].size() > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    return model


def _raw_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        grad = p.grad
        mesh = getattr(grad, "device_mesh", None)
        groups.setdefault(None if mesh is None else (id(mesh), str(grad.placements)), []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _windows(args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor.experimental import implicit_replication

    st = accel.state()
    mesh = st.mesh
    raw = _raw_model(args, mesh)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-3, foreach=True)
    torch.manual_seed(0)
    model = accel.prepare_model(Net(args["width"], args["blocks"]), tp_plan=PLAN)
    opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    g = torch.Generator().manual_seed(st.dp_rank)
    x = torch.randn(args["batch"], args["width"], generator=g)
    y = torch.randn(args["batch"], args["width"], generator=g)
    raw_params = list(raw.parameters())
    params = list(model.parameters())

    def raw_step() -> None:
        loss = nn.functional.mse_loss(raw(x), y)
        loss.backward()
        _raw_clip(raw_params, 1.0)
        with implicit_replication():  # plain and DTensor parameters in one foreach step
            raw_opt.step()
        raw_opt.zero_grad()

    def accel_step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        accel.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()

    def window(step: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args["steps"]):
            step()
        took = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took) / args["steps"] * 1e6

    for _ in range(3):  # warm-up: allocations, first collectives
        raw_step()
        accel_step()
    raw_us, accel_us = [], []
    for i in range(args["windows"]):
        pair = (raw_step, accel_step) if i % 2 == 0 else (accel_step, raw_step)
        first, second = window(pair[0]), window(pair[1])
        raw_us.append(first if i % 2 == 0 else second)
        accel_us.append(second if i % 2 == 0 else first)
    clip_raw, clip_accel = [], []  # the clip alone (gradients of the last step kept)
    loss = nn.functional.mse_loss(raw(x), y)
    loss.backward()
    accel.backward(nn.functional.mse_loss(model(x), y))
    for i in range(args["windows"]):
        calls = (lambda: _raw_clip(raw_params, 1e9), lambda: accel.clip_grad_norm_(params, 1e9))
        order = calls if i % 2 == 0 else calls[::-1]
        first, second = window(order[0]), window(order[1])
        clip_raw.append(first if i % 2 == 0 else second)
        clip_accel.append(second if i % 2 == 0 else first)
    raw_opt.zero_grad()
    opt.zero_grad()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args["steps"]):
        accel_step()
    profile.disable()
    stats = pstats.Stats(profile)
    own = 0.0
    top: list[tuple[float, str]] = []
    for (file, line, name), row in stats.stats.items():  # type: ignore[attr-defined]
        if "/accel/" in file and "/bench/" not in file:
            own += row[2]
            top.append((row[2], f"{Path(file).name}:{line}:{name}"))
    top.sort(reverse=True)
    return {
        "raw_us": raw_us, "accel_us": accel_us, "clip_raw_us": clip_raw,
        "clip_accel_us": clip_accel,
        "cprofile_own_us": own / args["steps"] * 1e6,
        "cprofile_top": [[name, round(t / args["steps"] * 1e6, 2)] for t, name in top[:6]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--windows", type=int, default=10)
    args = vars(parser.parse_args())
    out = run_distributed(
        _windows, args, world_size=args["procs"], timeout=1800, tp_size=args["tp"],
        dp_shard_size=args["procs"] // args["tp"],
    )[0]
    diffs = sorted(a - r for a, r in zip(out["accel_us"], out["raw_us"], strict=True))
    quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(json.dumps({
        "procs": args["procs"], "tp": args["tp"], "dp_shard": args["procs"] // args["tp"],
        "width": args["width"], "blocks": args["blocks"], "batch": args["batch"],
        "raw_us": round(statistics.median(out["raw_us"]), 1),
        "accel_us": round(statistics.median(out["accel_us"]), 1),
        "overhead_us": round(statistics.median(diffs), 1),
        "overhead_iqr_us": [round(quartiles[0], 1), round(quartiles[2], 1)],
        "clip_raw_us": round(statistics.median(out["clip_raw_us"]), 1),
        "clip_accel_us": round(statistics.median(out["clip_accel_us"]), 1),
        "clip_overhead_us": round(statistics.median(
            a - r for a, r in zip(out["clip_accel_us"], out["clip_raw_us"], strict=True)), 1),
        "cprofile_own_us": round(out["cprofile_own_us"], 1),
        "cprofile_top": out["cprofile_top"],
        "load_average": float(load),
    }, indent=1))


if __name__ == "__main__":
    main()

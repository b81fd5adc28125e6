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

With ``--pp P`` (``--procs`` = ``P``, one stage per rank) the row is pipeline parallelism:
the same residual MLP split into ``P`` stages by blocks (the head with the last), the same
batch split into ``--microbatches``, each schedule of ``--schedules`` (torch's names), AdamW:

- raw: ``PipelineStage`` over the rank's blocks built by hand, torch's schedule class
  (``Schedule1F1B(stage, n_microbatches=M, loss_fn=mse_loss)``), ``schedule.step(x)`` on the
  first stage and ``schedule.step(target=y, losses=losses)`` on the last, the mean loss
  broadcast from the last stage (every rank gets it, as ``pipeline_step`` returns it), then
  ``step``, ``zero_grad``;
- accel: ``accel.distributed(pp_size=P)``, ``prepare_model(pp_plan="auto", pp_schedule=,
  microbatches=)``, ``prepare_optimizer``, ``accel.pipeline_step(model, x, y,
  loss_fn=mse_loss)``, ``step``, ``zero_grad``.

Same windows and figures as above (``overhead_us`` and ``overhead_pct`` of the raw step; goal:
<= 2% or <= 50 us per step), ``loss_diff`` (the two loops' last losses: they train the same
weights on the same batches), ``glue_*_us`` (each loop's step minus its time inside torch's
schedule, broadcast and optimizer step, per rank, paired windows), ``stage_us`` (per rank,
one microbatch through the rank's stage module, raw's and accel's alternately, no messages:
``[raw, accel, paired difference]`` for the forward and the forward + backward) and
``cprofile_own_us``.

Usage:
    python bench/parallel.py                   # 4 processes, TP2 x FSDP2
    python bench/parallel.py --procs 2 --tp 2 --windows 6
    python bench/parallel.py --procs 2 --pp 2 --schedules 1F1B GPipe   # pipeline rows
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
import torch.distributed as dist
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


def _window(step: Any, steps: int) -> float:
    """Microseconds per call of ``step`` over ``steps`` calls, the slowest rank's (every rank
    starts together)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    took = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took) / steps * 1e6


def _windows(args: dict[str, Any]) -> dict[str, Any]:
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
        return _window(step, args["steps"])

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


def _raw_stage(args: dict[str, Any], rank: int, pp: int) -> nn.Module:
    """This rank's blocks (and the head on the last) of the seeded model, split by hand."""
    torch.manual_seed(0)
    whole = Net(args["width"], args["blocks"])
    per = args["blocks"] // pp
    parts: list[nn.Module] = list(whole.blocks[rank * per:(rank + 1) * per])
    if rank == pp - 1:
        parts.append(whole.head)
    return nn.Sequential(*parts)


def _profile_own(step: Any, steps: int) -> tuple[float, list[list[Any]]]:
    """Own time per step of the functions under ``accel/`` while ``step`` runs, profiled."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    own = 0.0
    top: list[tuple[float, str]] = []
    for (file, line, name), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if "/accel/" in file and "/bench/" not in file:
            own += row[2]
            top.append((row[2], f"{Path(file).name}:{line}:{name}"))
    top.sort(reverse=True)
    return own / steps * 1e6, [[name, round(t / steps * 1e6, 2)] for t, name in top[:6]]


def _pipeline_windows(args: dict[str, Any], schedule: str) -> dict[str, Any]:
    """One schedule: the raw torch loop and accel's in alternating windows, same processes."""
    from torch.distributed.pipelining import PipelineStage, schedules

    from accel.core.mesh import pp_mesh
    from accel.parallel.pipeline.schedules import schedule_spec
    from accel.parallel.pipeline.stages import pipeline_of

    st = accel.state()
    pp, rank = st.pp_world_size, st.pp_rank
    first, last = rank == 0, rank == pp - 1
    group = pp_mesh(st.mesh).get_group()
    spec = schedule_spec(schedule)
    cls = getattr(schedules, spec.cls_name)
    mse = nn.functional.mse_loss
    raw = _raw_stage(args, rank, pp)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-3, foreach=True)
    raw_schedule = cls(PipelineStage(raw, rank, pp, st.device, group=group),
                       n_microbatches=args["microbatches"], loss_fn=mse)
    torch.manual_seed(0)
    model = accel.prepare_model(Net(args["width"], args["blocks"]), pp_plan="auto",
                                pp_schedule=schedule, microbatches=args["microbatches"])
    opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args["batch"], args["width"], generator=g)
    y = torch.randn(args["batch"], args["width"], generator=g)
    last_loss = {"raw": torch.zeros(()), "accel": torch.zeros(())}

    def raw_step() -> None:
        losses: list[torch.Tensor] = []
        if first:
            raw_schedule.step(x)
        else:
            raw_schedule.step(target=y, losses=losses)
        mean = torch.stack(losses).mean() if last else torch.zeros(())
        dist.broadcast(mean, group=group, group_src=pp - 1)
        raw_opt.step()
        raw_opt.zero_grad()
        last_loss["raw"] = mean.detach()

    def accel_step() -> None:
        last_loss["accel"] = accel.pipeline_step(model, x, y, loss_fn=mse)
        opt.step()
        opt.zero_grad()

    def window(step: Any) -> float:
        return _window(step, args["steps"])

    for _ in range(3):  # warm-up: shape inference, allocations, the optimizers' state
        raw_step()
        accel_step()
    raw_us, accel_us = [], []
    for i in range(args["windows"]):
        pair = (raw_step, accel_step) if i % 2 == 0 else (accel_step, raw_step)
        one, two = window(pair[0]), window(pair[1])
        raw_us.append(one if i % 2 == 0 else two)
        accel_us.append(two if i % 2 == 0 else one)
    loss_diff = abs(float(last_loss["raw"]) - float(last_loss["accel"]))
    # the glue: each loop's step minus its time inside torch (the schedule's ``step``: the
    # stages' compute and messages; the loss's broadcast; the torch optimizer's ``step``),
    # where the noise is, in paired windows on this rank
    inside = [0.0]
    for sched in (raw_schedule, pipeline_of(model).schedule):  # type: ignore[union-attr]
        sched.step = _timed(sched.step, inside)
    for torch_opt in (raw_opt, opt.optimizer):
        torch_opt.step = _timed(torch_opt.step, inside)  # type: ignore[method-assign]
    broadcast = dist.broadcast
    dist.broadcast = _timed(broadcast, inside)
    raw_glue, accel_glue = [], []
    for i in range(args["windows"]):
        for step, into in ((raw_step, raw_glue), (accel_step, accel_glue))[::1 - 2 * (i % 2)]:
            inside[0] = 0.0
            start = time.perf_counter()
            for _ in range(args["steps"]):
                step()
            into.append((time.perf_counter() - start - inside[0]) / args["steps"] * 1e6)
    own, top = _profile_own(accel_step, args["steps"])
    stage = pipeline_of(model).modules[0]  # type: ignore[union-attr]
    return {"raw_us": raw_us, "accel_us": accel_us, "loss_diff": loss_diff,
            "raw_glue_us": raw_glue, "accel_glue_us": accel_glue,
            "stage_us": _stage_pairs(raw, stage, x[:args["batch"] // args["microbatches"]],
                                     args["windows"] * args["steps"]),
            "cprofile_own_us": own, "cprofile_top": top}


def _stage_pairs(raw: nn.Module, stage: nn.Module, x: torch.Tensor, reps: int
                 ) -> dict[str, list[float]]:
    """One microbatch through this rank's stage module, raw torch's and accel's, alternately
    (no messages: the stage's own compute): forward alone and forward + backward, µs."""
    x = x.detach().requires_grad_(True)

    def forward(module: nn.Module) -> None:
        with torch.no_grad():
            module(x)

    def both(module: nn.Module) -> None:
        module(x).sum().backward()

    out: dict[str, list[float]] = {}
    for name, run in (("forward", forward), ("forward_backward", both)):
        raw_us, accel_us = [], []
        for _ in range(reps):
            for module, into in ((raw, raw_us), (stage, accel_us)):
                start = time.perf_counter()
                run(module)
                into.append((time.perf_counter() - start) * 1e6)
        out[name] = [round(statistics.median(raw_us), 1), round(statistics.median(accel_us), 1),
                     round(statistics.median(a - r for a, r in zip(accel_us, raw_us,
                                                                    strict=True)), 1)]
    return out


def _timed(call: Any, total: list[float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start
    return timed


def _pipeline_rows(args: dict[str, Any]) -> dict[str, Any]:
    return {name: _pipeline_windows(args, name) for name in args["schedules"]}


def _summary(raw_us: list[float], accel_us: list[float]) -> dict[str, Any]:
    diffs = sorted(a - r for a, r in zip(accel_us, raw_us, strict=True))
    quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
    raw = statistics.median(raw_us)
    return {
        "raw_us": round(raw, 1), "accel_us": round(statistics.median(accel_us), 1),
        "overhead_us": round(statistics.median(diffs), 1),
        "overhead_pct": round(100 * statistics.median(diffs) / raw, 2),
        "overhead_iqr_us": [round(quartiles[0], 1), round(quartiles[2], 1)],
    }


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _pipeline_main(args: dict[str, Any]) -> None:
    if args["procs"] != args["pp"] or args["blocks"] % args["pp"]:
        raise SystemExit("--pp runs one stage per rank: --procs must equal --pp, and --blocks "
                         "be a multiple of it")
    out = run_distributed(_pipeline_rows, args, world_size=args["procs"], timeout=1800,
                          pp_size=args["pp"])
    rows = {}
    for name, got in out[0].items():
        slowest = out[-1][name]  # the last stage's own profile (it runs the loss)
        glue = [_summary(o[name]["raw_glue_us"], o[name]["accel_glue_us"]) for o in out]
        rows[name] = {**_summary(got["raw_us"], got["accel_us"]),
                      "loss_diff": got["loss_diff"],
                      "glue_raw_us": [g["raw_us"] for g in glue],  # per rank
                      "glue_accel_us": [g["accel_us"] for g in glue],
                      "glue_overhead_us": [g["overhead_us"] for g in glue],
                      "glue_overhead_iqr_us": [g["overhead_iqr_us"] for g in glue],
                      "stage_us": [o[name]["stage_us"] for o in out],  # per rank
                      "cprofile_own_us": [round(o[name]["cprofile_own_us"], 1) for o in out],
                      "cprofile_top_last_stage": slowest["cprofile_top"]}
    print(json.dumps({
        "procs": args["procs"], "pp": args["pp"], "width": args["width"],
        "blocks": args["blocks"], "batch": args["batch"], "microbatches": args["microbatches"],
        "steps": args["steps"], "windows": args["windows"], "schedules": rows,
        "load_average": _load(),
    }, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (one per process)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe"])
    args = vars(parser.parse_args())
    if args["pp"] > 1:
        _pipeline_main(args)
        return
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

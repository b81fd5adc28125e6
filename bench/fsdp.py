"""FSDP2 through accel vs raw ``fully_shard``: per-step time, peak RSS, checkpoints; prints JSON.

Runs on CPU processes over gloo (``accel.testing.run_distributed``).

Per step (``--step-procs``, default 2 then 1): the same model (``--blocks`` residual MLP blocks
of width ``--width`` in an ``nn.ModuleList`` and a head, AdamW with ``foreach=True``, MSE,
batch ``--batch`` per rank) is set up twice in the same processes:

- raw: ``fully_shard`` on each block and on the root over a device mesh, then a hand-written
  loop: ``model.set_requires_gradient_sync(is_sync_step)`` before each batch when
  accumulating, loss divided by the accumulation steps, ``backward``, ``step``/``zero_grad``
  on sync steps;
- accel: ``accel.distributed(strategy="fsdp", gradient_accumulation_steps=K)``,
  ``prepare_model``, an AdamW over the sharded parameters through ``prepare_optimizer``, and
  the loop ``with accel.accumulate(model): accel.backward(loss); step; zero_grad``.

Both are timed in alternating windows of ``--steps`` batches so machine drift hits both
(``raw_us``, ``accel_us``: the slowest rank's window time per step, median over windows;
``overhead_us``: median of the paired differences, with its interquartile range). Goal: accel
adds <= 25 us per step. On a shared 2-core machine gloo's jitter is far larger than that, so
two more figures locate accel's own cost:

- ``accel_own_us``: the same two loops of calls with the model work taken out (a one-element
  loss whose backward is trivial, a one-element SGD), still switching the real FSDP module's
  gradient sync, 2000 steps a window, paired windows: what accel's ``accumulate``,
  ``backward`` and prepared optimizer add per step;
- ``cprofile_own_us`` / ``cprofile_top``: own time of the functions under ``accel/`` per step
  of the real loop under cProfile (inflated by the profiler; shows where the time goes).

``procs=1`` runs the comparison with ``fully_shard`` on a one-process mesh (given to
``prepare_model`` already sharded, since accel does not shard on one process): the same
per-step code paths without cross-process waits.

Peak RSS per rank: ``VmHWM`` of each process after its measurements (it includes torch).

Checkpoints (``--procs`` processes; ``--ckpt-blocks`` blocks of ``Linear(--ckpt-width,
--ckpt-width)`` sharded with ``strategy="fsdp"``, AdamW state after one step):
``accel.save_state(dir, model=, optimizer=)`` and ``accel.load_state`` into the same objects,
against ``torch.distributed.checkpoint``'s own ``dcp.save`` / ``dcp.load`` (default
``FileSystemWriter``/``FileSystemReader``) of the same state, taken with ``get_state_dict``
and put back with ``set_state_dict``. Each time is the slowest rank's, from a barrier to the
end of the call; medians over ``--repeat`` repetitions alternating which goes first;
``ratios`` compares accel to dcp in the same run (loads read files hot in the page cache).

Usage:
    python bench/fsdp.py                              # everything
    python bench/fsdp.py --windows 10 --steps 20 --no-checkpoint --step-procs 2
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import accel
from accel.testing import run_distributed

ACCEL_DIR = str(Path(accel.__file__).resolve().parent)


class Block(nn.Module):
    """Residual MLP block (LayerNorm, Linear, GELU, Linear)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _raw_model(width: int, blocks: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net(width, blocks)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _raw_loop(model: Any, opt: torch.optim.Optimizer, data: Any, steps: int,
              accumulation: int) -> float:
    xs, ys = data
    loss_fn = nn.MSELoss()
    start = time.perf_counter()
    for i in range(steps):
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        sync = (i + 1) % accumulation == 0
        if accumulation > 1:
            model.set_requires_gradient_sync(sync)
        loss = loss_fn(model(x), y)
        if accumulation > 1:
            loss = loss / accumulation
        loss.backward()
        if sync:
            opt.step()
            opt.zero_grad()
    if accumulation > 1:
        model.set_requires_gradient_sync(True)
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


def _slowest(seconds: float) -> float:
    """The largest value over the ranks (every rank)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _accel_self_time(model: nn.Module, opt: Any, data: Any, steps: int,
                     windows: int) -> dict[str, Any]:
    """Own time per step of accel's functions under cProfile: median over windows."""
    totals: list[float] = []
    per_function: dict[str, list[float]] = {}
    for _ in range(windows):
        profiler = cProfile.Profile()
        profiler.enable()
        _accel_loop(model, opt, data, steps)
        profiler.disable()
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        total = 0.0
        for (filename, line, name), (_, calls, tottime, _, _) in stats.items():
            if filename.startswith(ACCEL_DIR):
                where = f"{filename[len(ACCEL_DIR) + 1:]}:{line}:{name} ({calls / steps:g}/step)"
                per_function.setdefault(where, []).append(tottime / steps)
                total += tottime / steps
        totals.append(total)
    medians = sorted(((statistics.median(v + [0.0] * (windows - len(v))), k)
                      for k, v in per_function.items()), reverse=True)
    return {
        "cprofile_own_us": round(statistics.median(totals) * 1e6, 2),
        "cprofile_own_us_p25_p75": [round(q * 1e6, 2)
                                    for q in statistics.quantiles(totals, n=4)[::2]],
        "cprofile_top": [f"{t * 1e6:.2f} us {where}" for t, where in medians[:8]],
    }


def _raw_calls(model: Any, opt: torch.optim.Optimizer, steps: int, accumulation: int) -> float:
    """The raw loop's per-step calls with no model work: sync flag, backward of a stub, step."""
    leaf = torch.zeros((), requires_grad=True)
    start = time.perf_counter()
    for i in range(steps):
        sync = (i + 1) % accumulation == 0
        if accumulation > 1:
            model.set_requires_gradient_sync(sync)
        loss = leaf * 1.0
        if accumulation > 1:
            loss = loss / accumulation
        loss.backward()
        if sync:
            opt.step()
            opt.zero_grad()
    if accumulation > 1:
        model.set_requires_gradient_sync(True)
    return time.perf_counter() - start


def _accel_calls(model: nn.Module, opt: Any, steps: int) -> float:
    """The accel loop's per-step calls with the same stub work as :func:`_raw_calls`."""
    leaf = torch.zeros((), requires_grad=True)
    start = time.perf_counter()
    for _ in range(steps):
        with accel.accumulate(model):
            accel.backward(leaf * 1.0)
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - start


def _accel_own_time(model: nn.Module, windows: int, steps: int,
                    accumulation: int) -> dict[str, Any]:
    """accel's own per-step cost: paired windows of the two loops of calls without model work.

    Both loops drive the same FSDP module's sync flag and a one-element SGD (its step is the
    same work in both); the difference is what accel's ``accumulate``, ``backward`` and
    prepared optimizer add per step.
    """
    raw_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    opt = accel.prepare_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    _raw_calls(model, raw_opt, steps, accumulation)
    _accel_calls(model, opt, steps)
    raw, acc = [], []
    for w in range(windows):
        for which in ((0, 1) if w % 2 == 0 else (1, 0)):
            if which == 0:
                raw.append(_raw_calls(model, raw_opt, steps, accumulation) / steps)
            else:
                acc.append(_accel_calls(model, opt, steps) / steps)
    diffs = [a - r for a, r in zip(acc, raw, strict=True)]
    return {
        "raw_calls_us": round(statistics.median(raw) * 1e6, 2),
        "accel_calls_us": round(statistics.median(acc) * 1e6, 2),
        "accel_own_us": round(statistics.median(diffs) * 1e6, 2),
        "accel_own_us_p25_p75": [round(q * 1e6, 2)
                                 for q in statistics.quantiles(diffs, n=4)[::2]],
    }


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def measure_steps(windows: int, steps: int, accumulation: int, width: int, blocks: int,
                  batch: int) -> dict[str, Any]:
    """Raw fully_shard loop vs accel loop in alternating windows (every rank)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1 + rank)
    data = (torch.randn(8, batch, width, generator=generator),
            torch.randn(8, batch, width, generator=generator))
    raw_model = _raw_model(width, blocks)
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-4, foreach=True)
    with accel.distributed(strategy="fsdp", gradient_accumulation_steps=accumulation):
        if dist.get_world_size() == 1:  # accel would not shard: give it a sharded model
            model = accel.prepare_model(_raw_model(width, blocks))
        else:
            torch.manual_seed(0)
            model = accel.prepare_model(Net(width, blocks))
        assert hasattr(model, "set_requires_gradient_sync"), "not an FSDP module"
        opt = accel.prepare_optimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
        _raw_loop(raw_model, raw_opt, data, steps, accumulation)  # warm up both
        _accel_loop(model, opt, data, steps)
        raw, acc = [], []
        for w in range(windows):
            order = (0, 1) if w % 2 == 0 else (1, 0)
            for which in order:
                dist.barrier()
                if which == 0:
                    took = _raw_loop(raw_model, raw_opt, data, steps, accumulation)
                    raw.append(_slowest(took) / steps)
                else:
                    acc.append(_slowest(_accel_loop(model, opt, data, steps)) / steps)
        own = _accel_own_time(model, windows, 2000, accumulation)
        profile = _accel_self_time(model, opt, data, steps, windows)
    diffs = [a - r for a, r in zip(acc, raw, strict=True)]
    return {
        "raw_us": round(statistics.median(raw) * 1e6, 1),
        "accel_us": round(statistics.median(acc) * 1e6, 1),
        "overhead_us": round(statistics.median(diffs) * 1e6, 1),
        "overhead_us_p25_p75": [round(q * 1e6, 1) for q in statistics.quantiles(diffs, n=4)[::2]],
        **own,
        **profile,
        "peak_rss_mib": _peak_rss_mib(),
    }


def _ckpt_objects(width: int, blocks: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = accel.prepare_model(nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)]))
    opt = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _timed(function: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    function()
    return _slowest(time.perf_counter() - start)


def measure_checkpoints(root: str, repeat: int, width: int, blocks: int) -> dict[str, Any]:
    """accel.save_state/load_state vs dcp.save/dcp.load of the same state (every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    rank = dist.get_rank()
    times: dict[str, list[float]] = {"accel_save": [], "accel_load": [], "dcp_save": [],
                                     "dcp_load": []}
    with accel.distributed(strategy="fsdp"):
        model, opt = _ckpt_objects(width, blocks)
        inner = opt.optimizer
        local = sum(p.to_local().numel() * 4 * 3 for p in model.parameters())  # + 2 moments
        for r in range(repeat):
            accel_dir, dcp_dir = Path(root) / f"accel_{r}", Path(root) / f"dcp_{r}"

            def dcp_save(dcp_dir: Path = dcp_dir) -> None:
                msd, osd = get_state_dict(model, inner)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)

            def dcp_load(dcp_dir: Path = dcp_dir) -> None:
                msd, osd = get_state_dict(model, inner)
                state = {"model": msd, "optim": osd}
                dcp.load(state, checkpoint_id=dcp_dir)
                set_state_dict(model, inner, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])

            def accel_save(accel_dir: Path = accel_dir) -> None:
                accel.save_state(accel_dir, model=model, optimizer=opt)

            def accel_load(accel_dir: Path = accel_dir) -> None:
                accel.load_state(accel_dir, model=model, optimizer=opt)

            pairs = [("accel", accel_save, accel_load), ("dcp", dcp_save, dcp_load)]
            for name, save, load in pairs if r % 2 == 0 else pairs[::-1]:
                times[f"{name}_save"].append(_timed(save))
                times[f"{name}_load"].append(_timed(load))
        total = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(total)
    sizes = {name: sum(f.stat().st_size for f in (Path(root) / f"{name}_0").rglob("*")
                       if f.is_file()) for name in ("accel", "dcp")}
    med = {key: statistics.median(values) for key, values in times.items()}
    return {
        "rank": rank,
        "state_bytes": int(total.item()),
        "files_bytes": sizes,
        "seconds_median": {key: round(value, 3) for key, value in med.items()},
        "seconds_all": {key: [round(v, 3) for v in values] for key, values in times.items()},
        "ratios": {
            "save_accel_vs_dcp": round(med["accel_save"] / med["dcp_save"], 2),
            "load_accel_vs_dcp": round(med["accel_load"] / med["dcp_load"], 2),
        },
        "peak_rss_mib": _peak_rss_mib(),
    }


def _load_average() -> list[float]:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--procs", type=int, default=2, help="processes for the checkpoints")
    parser.add_argument("--step-procs", type=int, nargs="*", default=[2, 1],
                        help="process counts for the per-step comparison")
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--ckpt-width", type=int, default=2048)
    parser.add_argument("--ckpt-blocks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "torch": torch.__version__, "python": sys.version.split()[0], "procs": args.procs,
        "windows": args.windows, "steps_per_window": args.steps,
        "model": {"width": args.width, "blocks": args.blocks, "batch_per_rank": args.batch},
        "load_average_before": _load_average(),
    }
    for procs in args.step_procs:
        for accumulation in (1, 4):
            results = run_distributed(measure_steps, args.windows, args.steps, accumulation,
                                      args.width, args.blocks, args.batch,
                                      world_size=procs, timeout=3600)
            report[f"procs={procs},accumulation={accumulation}"] = {
                **results[0], "peak_rss_mib": [r["peak_rss_mib"] for r in results]}
    if not args.no_checkpoint:
        root = tempfile.mkdtemp(prefix="accel-bench-fsdp-", dir=args.dir)
        try:
            results = run_distributed(measure_checkpoints, root, args.repeat, args.ckpt_width,
                                      args.ckpt_blocks, world_size=args.procs, timeout=3600)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        report["checkpoint"] = {
            "model": f"{args.ckpt_blocks} x Linear({args.ckpt_width}, {args.ckpt_width}) + AdamW",
            **{k: v for k, v in results[0].items() if k not in ("rank", "peak_rss_mib")},
            "peak_rss_mib": [r["peak_rss_mib"] for r in results],
        }
    report["load_average_after"] = _load_average()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""DeepSpeed ZeRO-2/3 through accel against a raw ``deepspeed.initialize`` loop; curve JSON.

On ``--procs`` CPU gloo processes (``accel.testing.run_distributed``; default 1 and 2), for
each ZeRO stage of ``--stages`` and each model width of ``--widths`` (``--layers`` residual
``Linear(w, w)`` + Tanh blocks and a head, AdamW, MSE, ``--batch`` rows per rank), the same
model is set up twice in the same processes:

- accel: ``accel.distributed(strategy="deepspeed", zero_stage=S)``, ``accel.prepare(model,
  optimizer, loader)`` and the loop ``with accel.accumulate(model): accel.backward(loss);
  optimizer.step(); optimizer.zero_grad()``;
- raw: ``deepspeed.initialize(model=, optimizer=, config=C)`` with C the config accel's engine
  runs (``current_run().config``: the same config, every "auto" filled), and the loop
  ``loss = mse(engine(x), y); engine.backward(loss); engine.step()``.

Both are timed in alternating windows of ``--steps`` steps (the slowest rank's window time
per step); per point: the medians, the median of the paired differences (accel - raw) with
its interquartile range, and that difference in % of the raw step (judged: within 2%).
``--profile`` adds, per point, accel's own time per step under cProfile (functions under
``accel/``) and its top entries, to locate a gap.

Curves written (``--json-out DIR``, default bench/curves; ``-`` prints only):
``deepspeed_zero{S}_{P}proc`` (step time vs parameters, accel and raw, overhead % derived).

Usage:
    python bench/curves_deepspeed.py                         # full quality (~4 min)
    python bench/curves_deepspeed.py --widths 32 64 --layers 2 --windows 2 --steps 2 \
        --procs 2 --stages 2 --json-out -                    # smoke
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curve_record import paired, record, write

import accel
from accel.testing import run_distributed

ACCEL_DIR = str(Path(accel.__file__).resolve().parent)


class Net(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def _net(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return Net(width, layers)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _accel_loop(model: Any, opt: Any, data: list[tuple[torch.Tensor, torch.Tensor]],
                steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        x, y = data[i % len(data)]
        with accel.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accel.backward(loss)
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - start


def _raw_loop(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        x, y = data[i % len(data)]
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return time.perf_counter() - start


def _profile(model: Any, opt: Any, data: Any, steps: int) -> dict[str, Any]:
    profiler = cProfile.Profile()
    profiler.enable()
    _accel_loop(model, opt, data, steps)
    profiler.disable()
    rows = []
    total = 0.0
    for (filename, line, name), (_, calls, tottime, _, _) in pstats.Stats(
            profiler).stats.items():  # type: ignore[attr-defined]
        if filename.startswith(ACCEL_DIR):
            total += tottime / steps
            rows.append((tottime / steps, f"{filename[len(ACCEL_DIR) + 1:]}:{line}:{name} "
                                          f"({calls / steps:g}/step)"))
    rows.sort(reverse=True)
    return {"cprofile_own_us": round(total * 1e6, 1),
            "cprofile_top": [f"{t * 1e6:.1f} us {w}" for t, w in rows[:6]]}


def measure(stage: int, width: int, layers: int, batch: int, windows: int, steps: int,
            profile: bool) -> dict[str, Any]:
    """accel and raw DeepSpeed engines on the same model, paired windows (every rank)."""
    import deepspeed

    from accel.parallel.deepspeed.engine import current_run

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(4)]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(batch * dist.get_world_size(), width)),
        batch_size=batch)
    with accel.distributed(strategy="deepspeed", zero_stage=stage):
        net = _net(width, layers)
        model, opt, _ = accel.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-4),
                                      loader)
        config = dict(current_run().config)
        raw_net = _net(width, layers)
        engine = deepspeed.initialize(
            model=raw_net, optimizer=torch.optim.AdamW(raw_net.parameters(), lr=1e-4),
            config=config)[0]
        _accel_loop(model, opt, data, steps)  # warm up both
        _raw_loop(engine, data, steps)
        raw, acc = [], []
        for w in range(windows):
            for which in ((0, 1) if w % 2 == 0 else (1, 0)):
                dist.barrier()
                if which == 0:
                    raw.append(_slowest(_raw_loop(engine, data, steps)) / steps)
                else:
                    acc.append(_slowest(_accel_loop(model, opt, data, steps)) / steps)
        extra = _profile(model, opt, data, steps) if profile else {}
    params = sum(p.numel() for p in raw_net.parameters()) if stage < 3 else sum(
        getattr(p, "ds_numel", p.numel()) for p in raw_net.parameters())
    return {"params": params, "tensors": len(list(raw_net.parameters())), "raw_s": raw,
            "accel_s": acc, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json-out", default=None,
                        help="directory for the curve files (default bench/curves; - prints only)")
    args = parser.parse_args()
    curves = []
    for stage in args.stages:
        for procs in args.procs:
            points = []
            for width in args.widths:
                out = run_distributed(measure, stage, width, args.layers, args.batch,
                                      args.windows, args.steps, args.profile,
                                      world_size=procs, timeout=1800)[0]
                stats = paired(out["raw_s"], out["accel_s"])
                points.append({"params": out["params"], "tensors": out["tensors"],
                               "width": width, **stats,
                               **{k: v for k, v in out.items() if k.startswith("cprofile")}})
            us = 1e6
            curves.append(record(
                f"deepspeed_zero{stage}_{procs}proc",
                f"DeepSpeed ZeRO-{stage} step, {procs} process(es): accel vs raw initialize",
                ("parameters", "log"), ("ms per step", "log"),
                [{"name": "accel", "points": [[p["params"], p["other"] * 1e3] for p in points],
                  "spread": [[q * 1e3 for q in p["other_iqr"]] for p in points]},
                 {"name": "raw deepspeed.initialize",
                  "points": [[p["params"], p["raw"] * 1e3] for p in points],
                  "spread": [[q * 1e3 for q in p["raw_iqr"]] for p in points]}],
                [{"name": "accel overhead % of raw step",
                  "points": [[p["params"], round(p["pct"], 2)] for p in points],
                  "spread": [[round(q, 2) for q in p["pct_iqr"]] for p in points]}],
                points=[{"params": p["params"], "tensors": p["tensors"], "width": p["width"],
                         "raw_ms": round(p["raw"] * 1e3, 3),
                         "accel_ms": round(p["other"] * 1e3, 3),
                         "overhead_us": round(p["diff"] * us, 1),
                         "overhead_us_iqr": [round(q * us, 1) for q in p["diff_iqr"]],
                         "overhead_pct": round(p["pct"], 2),
                         "overhead_pct_iqr": [round(q, 2) for q in p["pct_iqr"]],
                         **{k: v for k, v in p.items() if k.startswith("cprofile")}}
                        for p in points],
                derived_label="accel overhead, % of raw",
                goal="overhead_pct <= 2 at every point",
                goal_met=all(p["pct"] <= 2.0 for p in points),
                setup={"layers": args.layers, "batch_per_rank": args.batch,
                       "windows": args.windows, "steps": args.steps},
            ))
    write(curves, args.json_out)


if __name__ == "__main__":
    main()

"""Activation checkpointing: step memory and step time with and without it; prints JSON.

The model is transformer-ish: ``--depth`` residual blocks (LayerNorm, Linear width -> 4 x
width, GELU, Linear back) over ``--batch`` x ``--seq`` tokens of width ``--width``, a head,
AdamW, MSE. It is prepared with ``accel.prepare_model(model, activation_checkpointing=...)``
(one process), once without checkpointing ("off") and once with ``True`` (each block).

Each variant runs in a fresh Python process, so one variant's freed memory cannot hide the
other's. In a process: two warm-up steps (the gradients and AdamW's state then exist and
stay: ``zero_grad(set_to_none=False)``), then one measured step (forward, backward, optimizer
step) whose memory is

- on CUDA: ``torch.cuda.max_memory_allocated()`` during the step minus
  ``memory_allocated()`` before it;
- on CPU: the peak resident set size during the step (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``) minus the resident size before it. glibc's malloc is started with
  a fixed ``MALLOC_MMAP_THRESHOLD_`` (128 KiB), so every tensor larger than that is its own
  mapping, returned to the system when freed: the resident size follows the live tensors.

That difference is the step's activation memory (plus the backward's temporaries, the same
in both variants). The two variants run ``--pairs`` times, alternating which goes first;
``memory_reduction`` is 1 minus the median of the pairs' ``on / off`` ratios.

Step time: one more process holds both variants (the same weights) and times them in
``--windows`` alternating windows of ``--steps`` steps each (forward, backward, AdamW step),
so a change in the machine's load hits both alike; ``time_increase`` is the median of the
windows' paired ``on / off`` ratios minus 1 (``time_ratio_iqr``: their interquartile range).
Goal: activation memory down >= 50% for <= 40% more step time.

Usage:
    python bench/activation_checkpointing.py                       # defaults below
    python bench/activation_checkpointing.py --depth 4 --width 64 --pairs 1 --windows 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MMAP_THRESHOLD = 128 * 1024


def _build(args: argparse.Namespace, checkpointing: bool) -> tuple[Any, Any, Any]:
    """The prepared model, its prepared AdamW and one training step (inside ``distributed``)."""
    import torch
    from torch import nn

    import accel

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, width: int, depth: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
            self.head = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    device = accel.state().device
    model = accel.prepare_model(
        Net(args.width, args.depth), activation_checkpointing=checkpointing
    )
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(args.batch, args.seq, args.width, device=device)
    y = torch.randn(args.batch, args.seq, args.width, device=device)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):  # warm-up: gradients and AdamW state now exist
        step()
    return model, optimizer, step


def _child_memory(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import accel

    with accel.distributed() as st:
        model, _, step = _build(args, args.child == "on")
        if st.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            step_bytes = torch.cuda.max_memory_allocated() - before
            how = "cuda max_memory_allocated - memory_allocated"
        else:
            before = _status("VmRSS")
            reset = _reset_peak_rss()
            step()
            step_bytes = _status("VmHWM") - before
            how = "peak RSS (VmHWM) - RSS" + ("" if reset else " (VmHWM not reset)")
    return {
        "variant": args.child,
        "step_memory_mb": step_bytes / 2**20,
        "memory": how,
        "device": str(st.device),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _child_time(args: argparse.Namespace) -> dict[str, Any]:
    import accel

    with accel.distributed():
        steps = {"off": _build(args, False)[2], "on": _build(args, True)[2]}
        ratios, seconds = [], {"off": [], "on": []}
        for window in range(args.windows):
            order = ("off", "on") if window % 2 == 0 else ("on", "off")
            took = {}
            for variant in order:
                start = time.perf_counter()
                for _ in range(args.steps):
                    steps[variant]()
                took[variant] = (time.perf_counter() - start) / args.steps
                seconds[variant].append(took[variant])
            ratios.append(took["on"] / took["off"])
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "step_time_s": {k: statistics.median(v) for k, v in seconds.items()},
        "time_ratio": statistics.median(ratios),
        "time_ratio_iqr": [quartiles[0], quartiles[2]],
    }


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"/proc/self/status has no {field}: this bench needs Linux on CPU")


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _run_child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--child", variant, "--width", str(args.width),
        "--depth", str(args.depth), "--batch", str(args.batch), "--seq", str(args.seq),
        "--steps", str(args.steps), "--windows", str(args.windows),
    ]
    env = dict(os.environ)
    if variant != "time":  # the memory runs: tensors mapped one by one (slower, not timed)
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=2, help="off/on memory process pairs")
    parser.add_argument("--windows", type=int, default=10, help="timing windows per variant")
    parser.add_argument("--steps", type=int, default=3, help="steps per timing window")
    parser.add_argument("--child", choices=["off", "on", "time"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child_time(args) if args.child == "time" else _child_memory(args)))
        return
    pairs = []
    for index in range(args.pairs):
        order = ("off", "on") if index % 2 == 0 else ("on", "off")
        runs = {variant: _run_child(variant, args) for variant in order}
        pairs.append({
            "off_mb": runs["off"]["step_memory_mb"],
            "on_mb": runs["on"]["step_memory_mb"],
            "memory_ratio": runs["on"]["step_memory_mb"] / runs["off"]["step_memory_mb"],
        })
    timing = _run_child("time", args)
    memory = statistics.median(p["memory_ratio"] for p in pairs)
    slower = timing["time_ratio"]
    off = runs["off"]
    print(json.dumps({
        "model": {"width": args.width, "depth": args.depth, "batch": args.batch,
                  "seq": args.seq, "parameters": off["parameters"]},
        "device": off["device"],
        "memory_measure": off["memory"],
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "memory_pairs": pairs,
        "timing": timing,
        "memory_reduction": 1 - memory,
        "time_increase": slower - 1,
        "goal_met": 1 - memory >= 0.5 and slower - 1 <= 0.4,
    }, indent=2))


if __name__ == "__main__":
    main()

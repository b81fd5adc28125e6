"""Profiling a training loop: ``accel.profile`` (torch.profiler on every rank).

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/profiler.py \
        --output-trace-dir traces --record-shapes

Each rank profiles itself and, with ``--output-trace-dir``, writes its Chrome trace to
``traces/profile_<rank>.json`` when the block ends (open it in ``chrome://tracing`` or
Perfetto). Activities are given by name as in Accelerate's ``ProfileKwargs`` (``"cpu"``,
``"cuda"``; a device missing on this machine is dropped with a warning). The main process
prints the table of the most expensive operators. Lines that differ from a plain loop are
marked ``# accel:``. Synthetic data, no download.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


def make_data(n: int, seed: int) -> TensorDataset:
    """Four classes: the label is the argmax of a fixed linear map of the input."""
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-trace-dir", default=None)
    parser.add_argument("--record-shapes", action="store_true")
    parser.add_argument("--profile-memory", action="store_true")
    parser.add_argument("--with-flops", action="store_true")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    with accel.distributed(seed=0):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train = DataLoader(make_data(128, 1), batch_size=16, shuffle=True)
        model, optimizer, train = accel.prepare(model, optimizer, train)
        device = accel.state().device.type

        for epoch in range(args.epochs):
            model.train()
            # accel: torch.profiler's options, activities by name, a trace per rank
            with accel.profile(
                activities=["cpu", "cuda"],
                record_shapes=args.record_shapes,
                profile_memory=args.profile_memory,
                with_flops=args.with_flops,
                output_trace_dir=args.output_trace_dir,
            ) as prof:
                for x, y in train:
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            sort_by = "self_cpu_time_total" if device == "cpu" else f"self_{device}_time_total"
            accel.print(prof.key_averages().table(sort_by=sort_by, row_limit=8))
            accel.print(f"epoch {epoch}: last loss {loss.item():.4f}")
        if args.output_trace_dir:
            accel.print(f"traces written to {args.output_trace_dir}")


if __name__ == "__main__":
    main()

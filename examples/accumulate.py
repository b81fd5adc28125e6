"""Quicktour with gradient accumulation, gradient clipping and a learning rate schedule.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/accumulate.py --accumulation-steps 4

The optimizer steps once every ``--accumulation-steps`` batches (and on the last batch of each
epoch); in between, DDP does not all-reduce the gradients. Lines that differ from the
quicktour are marked ``# accel:``.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


def make_data(n: int, features: int, classes: int) -> TensorDataset:
    """A learnable problem: the label is the argmax of a fixed linear map of the input."""
    w = torch.randn(features, classes, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(n))
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()

    # accel: the accumulation policy is set once, for the block
    with accel.distributed(seed=0, gradient_accumulation_steps=args.accumulation_steps):
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        train = DataLoader(make_data(512, 10, 5), batch_size=args.batch_size, shuffle=True)
        valid = DataLoader(make_data(200, 10, 5), batch_size=args.batch_size)
        # accel: written for one process: optimizer steps = batches / accumulation steps.
        # The prepared scheduler advances world_size steps per optimizer step, so the same
        # schedule ends on time with any number of processes.
        total_steps = args.epochs * math.ceil(len(train) / args.accumulation_steps)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=args.lr, total_steps=total_steps
        )
        model, optimizer, train, valid, scheduler = accel.prepare(
            model, optimizer, train, valid, scheduler
        )

        optimizer_steps = 0
        for epoch in range(args.epochs):
            model.train()
            for x, y in train:
                # accel: count batches; sync (and step) every k-th and on the epoch's last
                with accel.accumulate(model) as sync:
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)  # accel: divides the loss by the accumulation steps
                    if sync:  # accel: clip the full accumulated gradient only
                        accel.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()  # accel: does nothing until the sync step
                    scheduler.step()
                    optimizer.zero_grad()
                optimizer_steps += int(accel.sync_gradients())

            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in valid:
                    predictions = model(x).argmax(dim=1)
                    predictions, y = accel.gather_for_metrics((predictions, y))
                    correct += int((predictions == y).sum())
                    total += y.numel()
            accel.print(
                f"epoch {epoch}: accuracy {correct / total:.3f}, "
                f"{optimizer_steps} optimizer steps, lr {scheduler.get_last_lr()[0]:.4f}"
            )


if __name__ == "__main__":
    main()

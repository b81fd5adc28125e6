"""Quicktour in mixed precision: bf16 or fp16 autocast, fp16 loss scaling, skipped steps.

Run on 2 CPU processes (bf16 and fp16 both work on CPU as well as on CUDA):

    accel launch --nproc-per-node 2 --cpu examples/mixed_precision.py --mixed-precision bf16
    accel launch --nproc-per-node 2 --cpu examples/mixed_precision.py --mixed-precision fp16

The prepared model runs its forward under autocast and returns fp32 outputs; under fp16 a
GradScaler scales the loss, and a step whose gradients overflowed is skipped (as is the
scheduler's step). Lines that differ from the quicktour are marked ``# accel:``.
"""

from __future__ import annotations

import argparse

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
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="bf16")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    # accel: the precision policy for the block (also `accel launch --mixed-precision bf16`)
    with accel.distributed(seed=0, mixed_precision=args.mixed_precision):
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
        train = DataLoader(make_data(512, 10, 5), batch_size=args.batch_size, shuffle=True)
        valid = DataLoader(make_data(200, 10, 5), batch_size=args.batch_size)
        model, optimizer, train, valid, scheduler = accel.prepare(
            model, optimizer, train, valid, scheduler
        )

        skipped = 0
        for epoch in range(args.epochs):
            model.train()
            for x, y in train:
                logits = model(x)  # accel: computed in bf16/fp16, returned as fp32
                # accel: code outside the model can use the same policy
                with accel.autocast():
                    loss = nn.functional.cross_entropy(logits, y)
                accel.backward(loss)  # accel: scales the loss under fp16
                accel.clip_grad_norm_(model.parameters(), 1.0)  # accel: unscales first
                optimizer.step()  # accel: skipped if the fp16 gradients overflowed
                scheduler.step()  # accel: skipped with it
                optimizer.zero_grad()
                skipped += int(accel.optimizer_step_was_skipped(optimizer))

            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in valid:
                    predictions = model(x).argmax(dim=1)
                    predictions, y = accel.gather_for_metrics((predictions, y))
                    correct += int((predictions == y).sum())
                    total += y.numel()
            accel.print(
                f"epoch {epoch} ({args.mixed_precision}): accuracy {correct / total:.3f}, "
                f"{skipped} skipped steps so far"
            )


if __name__ == "__main__":
    main()

"""Quicktour from a notebook: the training loop is a function that notebook_launcher runs.

Run it like a notebook would, from a plain Python process (2 CPU processes over gloo here; one
process per GPU on a GPU machine):

    python examples/notebook_launcher.py --num-processes 2

In Jupyter, paste ``training_loop`` into a cell and call
``accel.notebook_launcher(training_loop, (args,), num_processes=2)`` in the next one. Keep
every CUDA call inside the function: the launcher forks, and refuses when the notebook
already initialised CUDA. Lines that differ from the quicktour are marked ``# accel:``.
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


def training_loop(args: argparse.Namespace) -> float:
    """The whole quicktour loop; runs on every process. Returns the validation accuracy."""
    # accel: joins the job the launcher started (mixed precision comes from the launcher)
    with accel.distributed(seed=0):
        model = nn.Linear(10, 5)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
        train = DataLoader(make_data(1024, 10, 5), batch_size=args.batch_size, shuffle=True)
        valid = DataLoader(make_data(200, 10, 5), batch_size=args.batch_size)
        model, optimizer, train, valid, scheduler = accel.prepare(
            model, optimizer, train, valid, scheduler
        )

        accuracy = 0.0
        for epoch in range(args.epochs):
            model.train()
            for x, y in train:
                loss = nn.functional.cross_entropy(model(x), y)
                accel.backward(loss)  # accel: instead of loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            scheduler.step()

            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in valid:
                    predictions = model(x).argmax(dim=1)
                    # accel: every process's predictions, without the padding duplicates
                    predictions, y = accel.gather_for_metrics((predictions, y))
                    correct += int((predictions == y).sum())
                    total += y.numel()
            accuracy = correct / total
            accel.print(f"epoch {epoch}: accuracy {accuracy:.3f}")  # accel: printed once
        return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default="no")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    # accel: one call starts the processes; each returns its accuracy (the same on every rank)
    accuracies = accel.notebook_launcher(
        training_loop, (args,), num_processes=args.num_processes,
        mixed_precision=args.mixed_precision,
    )
    print(f"final accuracy on {len(accuracies)} processes: {accuracies[0]:.3f}")


if __name__ == "__main__":
    main()

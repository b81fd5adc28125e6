"""Quicktour with experiment tracking: loss and accuracy logged to jsonl and tensorboard.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/tracking.py --project-dir runs

Only the main process writes: ``runs/<run>/metrics.jsonl``, ``runs/<run>/config.json`` and the
tensorboard event file (when the ``accel[tensorboard]`` extra is installed); view them with
``tensorboard --logdir runs``. Lines that differ from the quicktour are marked ``# accel:``.
"""

from __future__ import annotations

import argparse
import importlib.util

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
    parser.add_argument("--project-dir", default="runs")
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    # accel: jsonl needs nothing; tensorboard is the optional extra accel[tensorboard]
    log_with = ["jsonl"]
    if importlib.util.find_spec("tensorboard") is not None:
        log_with.append("tensorboard")

    with accel.distributed(seed=0):
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5))
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        train = DataLoader(make_data(512, 10, 5), batch_size=args.batch_size, shuffle=True)
        valid = DataLoader(make_data(200, 10, 5), batch_size=args.batch_size)
        model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)

        # accel: start the trackers (main process only) and record the hyper-parameters
        with accel.tracking(
            args.project_dir, log_with=log_with, config=vars(args), run_name=args.run_name
        ) as run:
            step = 0
            for epoch in range(args.epochs):
                model.train()
                for x, y in accel.progress(train, desc=f"epoch {epoch}"):
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    # accel: the mean loss over ranks, logged once (by the main process)
                    accel.log({"train/loss": accel.reduce(loss.detach(), "mean")}, step=step)
                    step += 1

                model.eval()
                correct = total = 0
                with torch.no_grad():
                    for x, y in valid:
                        predictions = model(x).argmax(dim=1)
                        predictions, y = accel.gather_for_metrics((predictions, y))
                        correct += int((predictions == y).sum())
                        total += y.numel()
                # accel: one row per epoch; numbers, tensors and nested dicts are accepted
                accel.log({"eval": {"accuracy": correct / total, "epoch": epoch}}, step=step)
                accel.print(f"epoch {epoch}: accuracy {correct / total:.3f}")
        if run.directory is not None:
            accel.print(f"logged to {run.directory} with {', '.join(run.tracker_names)}")


if __name__ == "__main__":
    main()

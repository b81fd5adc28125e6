"""Experiment tracking: the built-in ``jsonl`` tracker plus a tracker of your own (CSV).

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/tracking.py \
        --with-tracking --project-dir runs --run-name demo

Only the main process writes, once per epoch: ``runs/demo/metrics.jsonl`` and
``runs/demo/config.json`` (jsonl tracker) and ``runs/demo/metrics.csv`` (the ``CsvTracker``
below: any object with ``name``, ``log(values, step)`` and ``finish()`` is a tracker). The
logged training loss is the mean over all ranks' batches. ``tensorboard``, ``wandb`` and
``mlflow`` are built in too (optional extras). Lines that differ from a plain loop are marked
``# accel:``. Synthetic data, no download.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


def make_data(n: int, seed: int) -> TensorDataset:
    """Four classes: the label is the argmax of a fixed linear map of the input."""
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ w).argmax(dim=1))


class CsvTracker:
    """A custom tracker: one CSV row per ``accel.log`` call (columns fixed by the first)."""

    name = "csv"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None

    def log(self, values: Mapping[str, int | float | str], step: int | None) -> None:
        if self._writer is None:  # opened on the first row: only the main process logs
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", newline="", encoding="utf-8")  # noqa: SIM115
            self._writer = csv.DictWriter(self._file, fieldnames=["step", *values])
            self._writer.writeheader()
        self._writer.writerow({"step": step, **values})

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--with-tracking", action="store_true")
    parser.add_argument("--project-dir", default="runs")
    parser.add_argument("--run-name", default="by_feature_tracking")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    # accel: no tracking at all is log_with=None (accel.log then needs no guard)
    log_with = ["jsonl", CsvTracker(Path(args.project_dir) / args.run_name / "metrics.csv")]
    with accel.distributed(seed=0), accel.tracking(
        args.project_dir,
        log_with=log_with if args.with_tracking else None,
        config={"lr": args.lr, "epochs": args.epochs, "seed": 0},
        run_name=args.run_name,
    ):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        train = DataLoader(make_data(256, 1), batch_size=16, shuffle=True)
        valid = DataLoader(make_data(64, 2), batch_size=16)
        model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)

        step = 0
        for epoch in range(args.epochs):
            model.train()
            total_loss = torch.zeros(())
            for x, y in train:
                loss = nn.functional.cross_entropy(model(x), y)
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                total_loss += loss.detach()
                step += 1

            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in valid:
                    predictions, labels = accel.gather_for_metrics((model(x).argmax(1), y))
                    correct += int((predictions == labels).sum())
                    total += labels.numel()
            # accel: a collective (every rank), then logged by the main process only
            train_loss = accel.reduce(total_loss / len(train), "mean")
            accel.log({"accuracy": correct / total, "train_loss": float(train_loss),
                       "epoch": epoch}, step=step)
            accel.print(f"epoch {epoch}: accuracy {correct / total:.3f}, "
                        f"train loss {float(train_loss):.4f}")


if __name__ == "__main__":
    main()

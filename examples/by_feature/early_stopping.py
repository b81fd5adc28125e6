"""Early stopping: any rank can decide to stop, and every rank stops at the same step.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/early_stopping.py

Each rank watches its own training loss (its shard of the data differs from the other
ranks'). When it has not improved by ``--min-delta`` for ``--patience`` steps, that rank calls
``accel.set_trigger()``; ``accel.check_trigger()``, called by every rank after every step, is
then ``True`` on all of them at the same step, so no rank is left waiting in a collective.
Each rank prints the step it stopped at. Lines that differ from a plain loop are marked
``# accel:``. Synthetic data, no download.
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


class EarlyStopping:
    """Stop when the loss has not improved by ``min_delta`` for ``patience`` checks."""

    def __init__(self, min_delta: float, patience: int) -> None:
        self.min_delta = min_delta
        self.patience = patience
        self.best = float("inf")
        self.bad_checks = 0

    def should_stop(self, loss: float) -> bool:
        if loss < self.best - self.min_delta:
            self.best = loss
            self.bad_checks = 0
        else:
            self.bad_checks += 1
        return self.bad_checks >= self.patience


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--min-delta", type=float, default=0.0)
    parser.add_argument("--patience", type=int, default=5)
    args = parser.parse_args()

    with accel.distributed(seed=0):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train = DataLoader(make_data(256, 1), batch_size=16, shuffle=True)
        model, optimizer, train = accel.prepare(model, optimizer, train)
        callback = EarlyStopping(args.min_delta, args.patience)
        rank = accel.state().rank

        step = 0
        set_here: int | None = None
        stopped = False
        for _ in range(args.epochs):
            model.train()
            for x, y in train:
                loss = nn.functional.cross_entropy(model(x), y)
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if callback.should_stop(loss.item()):  # this rank's own decision
                    accel.set_trigger()  # accel: not a collective, only this rank
                    if set_here is None:
                        set_here = step
                if accel.check_trigger():  # accel: every rank, every step (a collective)
                    stopped = True
                    break
            if stopped:
                break
        total = args.epochs * len(train)
        # every rank reports (print would only show the local main process)
        print(f"rank {rank}: stopped at step {step} of {total} "
              f"(trigger set here at step {set_here})", flush=True)


if __name__ == "__main__":
    main()

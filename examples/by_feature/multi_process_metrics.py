"""Exact metrics on several processes: ``accel.gather_for_metrics``, and the manual way.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/multi_process_metrics.py

The validation set has 37 samples and the batch size is 8, so the prepared loader completes
the last round with samples from the start of the set (every rank gets a full batch; the
ranks stay in step). Those repeats must not be counted. ``gather_for_metrics`` drops them;
the manual way (``gather`` everything, then cut the last gathered batch to the samples not yet
seen) gives the same rows. Both counts are printed: 37 with any number of processes. Lines that
differ from a plain loop are marked ``# accel:``. Synthetic data, no download.
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
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--eval-samples", type=int, default=37)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    with accel.distributed(seed=0):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train = DataLoader(make_data(256, 1), batch_size=args.batch_size, shuffle=True)
        valid = DataLoader(make_data(args.eval_samples, 2), batch_size=args.batch_size)
        model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)

        for epoch in range(args.epochs):
            model.train()
            for x, y in train:
                loss = nn.functional.cross_entropy(model(x), y)
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

            model.eval()
            auto_correct = auto_count = 0
            manual_correct = manual_count = samples_seen = 0
            with torch.no_grad():
                for step, (x, y) in enumerate(valid):
                    predictions = model(x).argmax(dim=1)
                    # accel: the automatic way, repeats of the last round dropped
                    p, r = accel.gather_for_metrics((predictions, y))
                    auto_correct += int((p == r).sum())
                    auto_count += r.numel()
                    # the manual way: gather everything, cut the last gathered batch
                    p, r = accel.gather((predictions, y))
                    if step == len(valid) - 1:
                        p = p[: len(valid.dataset) - samples_seen]
                        r = r[: len(valid.dataset) - samples_seen]
                    else:
                        samples_seen += r.numel()
                    manual_correct += int((p == r).sum())
                    manual_count += r.numel()
            accel.print(
                f"epoch {epoch}: gather_for_metrics: {auto_count} samples, accuracy "
                f"{auto_correct / auto_count:.4f}; manual: {manual_count} samples, accuracy "
                f"{manual_correct / manual_count:.4f}"
            )


if __name__ == "__main__":
    main()

"""Find the largest batch size that fits: ``accel.find_executable_batch_size``.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/memory.py --simulated-max-batch 16

The training loop is a function taking ``batch_size`` first; the decorator calls it with
``--starting-batch-size`` and, after every out-of-memory error, frees memory and calls it again
with half the size. The ranks agree after each attempt, so they all try the same sizes and
settle on the same one. A CPU with plenty of RAM never runs out of memory on this small
model, so ``--simulated-max-batch`` raises ``torch.OutOfMemoryError`` (what CUDA raises) for
larger batches, before the forward pass, on every rank. Lines that differ from a plain loop
are marked ``# accel:``. Synthetic data, no download.
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
    parser.add_argument("--starting-batch-size", type=int, default=128)
    parser.add_argument("--simulated-max-batch", type=int, default=None,
                        help="raise torch.OutOfMemoryError for per-process batches above this")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    with accel.distributed():
        # accel: the decorator passes batch_size; build everything that depends on it inside
        @accel.find_executable_batch_size(starting_batch_size=args.starting_batch_size)
        def inner_training_loop(batch_size: int) -> int:
            accel.print(f"trying batch size {batch_size}")
            accel.set_seed(0)  # the same initial weights at every attempt
            model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            train = DataLoader(make_data(1024, 1), batch_size=batch_size, shuffle=True)
            valid = DataLoader(make_data(200, 2), batch_size=batch_size)
            model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)
            for epoch in range(args.epochs):
                model.train()
                for x, y in train:
                    if args.simulated_max_batch is not None and len(x) > args.simulated_max_batch:
                        raise torch.OutOfMemoryError(
                            f"CUDA out of memory (simulated: a batch of {len(x)} > "
                            f"{args.simulated_max_batch})"
                        )
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                model.eval()
                correct = total = 0
                with torch.no_grad():
                    for x, y in valid:
                        predictions, labels = accel.gather_for_metrics((model(x).argmax(1), y))
                        correct += int((predictions == labels).sum())
                        total += labels.numel()
                accel.print(f"epoch {epoch}: accuracy {correct / total:.3f}")
            return batch_size

        settled = inner_training_loop()  # accel: called without the batch size
        print(f"rank {accel.state().rank}: settled on batch size {settled}", flush=True)


if __name__ == "__main__":
    main()

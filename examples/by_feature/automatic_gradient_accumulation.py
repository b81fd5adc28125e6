"""Automatic gradient accumulation: keep the observed batch size when a smaller batch must do.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu \
        examples/by_feature/automatic_gradient_accumulation.py --simulated-max-batch 8

``accel.find_executable_batch_size`` halves the batch size after each out-of-memory error
(simulated here: ``torch.OutOfMemoryError`` for per-process batches above
``--simulated-max-batch``); the loop then accumulates ``observed // batch_size`` batches per
optimizer step, so each step still sees the observed batch. The state is immutable (assigning
``accel.state().gradient_accumulation_steps`` raises): open a nested
``with accel.distributed(gradient_accumulation_steps=n):`` instead, as below. Finally the
script trains once more with the observed batch and no accumulation, and prints the largest
difference between the two sets of weights. Lines that differ from a plain loop are marked
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


def train(batch_size: int, accumulation_steps: int, max_batch: int | None,
          epochs: int) -> nn.Module:
    """Train from the same initial weights; return the trained (unwrapped) model."""
    # accel: a nested block changes the accumulation steps for this run only
    with accel.distributed(gradient_accumulation_steps=accumulation_steps):
        accel.set_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = DataLoader(make_data(256, 1), batch_size=batch_size, shuffle=True)
        model, optimizer, loader = accel.prepare(model, optimizer, loader)
        optimizer_steps = 0
        for _ in range(epochs):
            for x, y in loader:
                if max_batch is not None and len(x) > max_batch:
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory (simulated: a batch of {len(x)} > {max_batch})"
                    )
                with accel.accumulate(model):
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                optimizer_steps += int(accel.sync_gradients())
        accel.print(f"batch size {batch_size} x {accel.state().gradient_accumulation_steps} "
                    f"accumulation steps: {optimizer_steps} optimizer steps")
        return accel.unwrap_model(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--observed-batch-size", type=int, default=32)
    parser.add_argument("--simulated-max-batch", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    observed = args.observed_batch_size

    with accel.distributed():
        @accel.find_executable_batch_size(starting_batch_size=observed)
        def inner_training_loop(batch_size: int) -> tuple[int, nn.Module]:
            accel.print(f"trying batch size {batch_size}")
            steps = observed // batch_size  # accel: then a nested distributed() block
            return batch_size, train(batch_size, steps, args.simulated_max_batch, args.epochs)

        batch_size, model = inner_training_loop()
        accel.print(f"settled on batch size {batch_size} with "
                    f"{observed // batch_size} accumulation steps")

        full = train(observed, 1, None, args.epochs)  # the observed batch, for comparison
        pairs = zip(model.parameters(), full.parameters(), strict=True)
        difference = max((p - q).abs().max().item() for p, q in pairs)
        accel.print(f"max difference from the observed batch: {difference:.3g}")


if __name__ == "__main__":
    main()

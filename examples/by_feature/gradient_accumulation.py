"""Gradient accumulation: ``accel.accumulate`` gives the gradient of the large batch.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/gradient_accumulation.py \
        --gradient-accumulation-steps 4

With a per-process batch of ``--batch-size`` and ``k`` accumulation steps, each optimizer step
sees ``batch_size * k * processes`` samples. Inside ``accel.accumulate(model)`` the optimizer
only steps on the sync step (every ``k``-th batch and the loader's last), DDP only all-reduces
then, and ``accel.backward`` divides the loss by ``k``. To show that this is the large batch,
every rank also trains a plain copy of the model on the gathered large batches and the
script prints the largest difference between the two sets of weights. Lines that differ from
a plain loop are marked ``# accel:``. Synthetic data, no download.
"""

from __future__ import annotations

import argparse
import copy

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
    parser.add_argument("--gradient-accumulation-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    k = args.gradient_accumulation_steps

    # accel: the accumulation policy is set once, for the block
    with accel.distributed(seed=0, gradient_accumulation_steps=k):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        reference = copy.deepcopy(model)  # trained on the large batches, for the comparison
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        train = DataLoader(make_data(256, 1), batch_size=args.batch_size, shuffle=True)
        model, optimizer, train = accel.prepare(model, optimizer, train)

        optimizer_steps = 0
        large_batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        for epoch in range(args.epochs):
            model.train()
            for x, y in train:
                with accel.accumulate(model):  # accel: sync (and step) only every k-th batch
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)  # accel: divides by k
                    optimizer.step()  # accel: does nothing until the sync step
                    optimizer.zero_grad()

                # the comparison: the same samples from every rank, in one large batch
                large_batch.append(accel.gather((x, y)))
                if accel.sync_gradients():
                    optimizer_steps += 1
                    big_x = torch.cat([b[0] for b in large_batch])
                    big_y = torch.cat([b[1] for b in large_batch])
                    nn.functional.cross_entropy(reference(big_x), big_y).backward()
                    ref_optimizer.step()
                    ref_optimizer.zero_grad()
                    large_batch.clear()
            accel.print(f"epoch {epoch}: {optimizer_steps} optimizer steps, last loss "
                        f"{loss.item():.4f}")

        pairs = zip(accel.unwrap_model(model).parameters(), reference.parameters(), strict=True)
        difference = max((p - r).abs().max().item() for p, r in pairs)
        accel.print(f"samples per optimizer step: {args.batch_size * k * accel.state().world_size}")
        accel.print(f"max difference from the large batch: {difference:.3g}")


if __name__ == "__main__":
    main()

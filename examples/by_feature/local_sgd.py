"""LocalSGD: each rank trains on its own, and the ranks average their weights every k steps.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/local_sgd.py --local-sgd-steps 8

Inside ``with accel.LocalSGD(model=model, local_sgd_steps=k):`` DDP does not all-reduce the
gradients, so the replicas drift apart; every ``k``-th ``local_sgd.step()`` (called after each
optimizer step) replaces each parameter by its mean over the ranks, and leaving the block
averages once more. Fewer, larger communications than DDP, at some cost in accuracy. To show
it, the script compares the ranks' weights after every step (a gather added for the demo)
and prints whether they agree after each averaging and differ in between. Lines that differ
from a plain loop are marked ``# accel:``. Synthetic data, no download.
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


def ranks_agree(model: nn.Module) -> bool:
    """Whether every rank holds the same weights (a collective: every rank calls it)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = accel.gather(flat[None])  # one row per rank
    return bool((everyone == everyone[0]).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local-sgd-steps", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    with accel.distributed(seed=0, gradient_accumulation_steps=args.gradient_accumulation_steps):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train = DataLoader(make_data(320, 1), batch_size=8, shuffle=True)
        valid = DataLoader(make_data(64, 2), batch_size=16)
        model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)

        for epoch in range(args.epochs):
            model.train()
            agree_after_sync: list[bool] = []
            differ_between = 0
            # accel: Accelerate's LocalSGD without the accelerator argument
            with accel.LocalSGD(model=model, local_sgd_steps=args.local_sgd_steps,
                                enabled=args.local_sgd_steps is not None) as local_sgd:
                for x, y in train:
                    with accel.accumulate(model):
                        loss = nn.functional.cross_entropy(model(x), y)
                        accel.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad()
                        local_sgd.step()  # accel: averages every local_sgd_steps calls
                    agree = ranks_agree(model)  # the demo's check, not needed for training
                    if local_sgd.num_steps % args.local_sgd_steps == 0:
                        agree_after_sync.append(agree)
                    else:
                        differ_between += not agree
            at_exit = ranks_agree(model)  # the block's exit averaged once more

            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in valid:
                    predictions, labels = accel.gather_for_metrics((model(x).argmax(1), y))
                    correct += int((predictions == labels).sum())
                    total += labels.numel()
            accel.print(
                f"epoch {epoch}: LocalSGD active: {local_sgd.enabled} (off on one process), "
                f"{local_sgd.num_steps} steps, {len(agree_after_sync)} "
                f"averagings, ranks agree after each: {all(agree_after_sync)}, ranks differed "
                f"at {differ_between} of the other steps, agree at the end: {at_exit}, "
                f"accuracy {correct / total:.3f}"
            )


if __name__ == "__main__":
    main()

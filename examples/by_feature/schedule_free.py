"""Schedule-free optimizers (``pip install schedulefree``): no scheduler, ``train()``/``eval()``.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/schedule_free.py

``schedulefree.AdamWScheduleFree`` keeps two points: training steps evaluate the gradient at
one, evaluation must use the averaged other. ``optimizer.train()`` before training and
``optimizer.eval()`` before evaluating (and before saving) switch between them. The prepared
optimizer passes both calls to the wrapped one (so does ``load_state_dict``/``state_dict``).
The script prints the optimizer's mode and how far ``eval()`` moved the weights. Lines that
differ from a plain loop are marked ``# accel:``. Synthetic data, no download.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel

try:
    import schedulefree
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise SystemExit("This example needs schedulefree: pip install schedulefree") from exc


def make_data(n: int, seed: int) -> TensorDataset:
    """Four classes: the label is the argmax of a fixed linear map of the input."""
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    with accel.distributed(seed=0):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        optimizer = schedulefree.AdamWScheduleFree(model.parameters(), lr=args.lr,
                                                   warmup_steps=5)
        train = DataLoader(make_data(256, 1), batch_size=16, shuffle=True)
        valid = DataLoader(make_data(64, 2), batch_size=16)
        model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)

        for epoch in range(args.epochs):
            model.train()
            optimizer.train()  # accel: the prepared optimizer passes it through
            for x, y in train:
                loss = nn.functional.cross_entropy(model(x), y)
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

            before = [p.detach().clone() for p in model.parameters()]
            model.eval()
            optimizer.eval()  # accel: the averaged weights, for evaluation (and for saving)
            pairs = zip(model.parameters(), before, strict=True)
            moved = max((p - b).abs().max().item() for p, b in pairs)
            correct = total = 0
            with torch.no_grad():
                for x, y in valid:
                    predictions, labels = accel.gather_for_metrics((model(x).argmax(1), y))
                    correct += int((predictions == labels).sum())
                    total += labels.numel()
            mode = "train" if optimizer.param_groups[0]["train_mode"] else "eval"
            accel.print(f"epoch {epoch}: accuracy {correct / total:.3f}, optimizer in {mode} "
                        f"mode, eval() moved the weights by up to {moved:.3g}")


if __name__ == "__main__":
    main()

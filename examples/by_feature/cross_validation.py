"""K-fold cross validation: one model per fold, fold metrics and an ensemble over the folds.

Run on 2 CPU processes:

    accel launch --nproc-per-node 2 --cpu examples/by_feature/cross_validation.py --num-folds 3

Each fold trains a fresh model on the other folds' samples and evaluates it on its own; its
logits on the test set are gathered (``gather_for_metrics``: every test sample exactly once,
in order) and the folds' averaged logits give the ensemble's test accuracy. The fold sizes are
not multiples of ``batch_size * processes``, so counts show that nothing is repeated. Lines that
differ from a plain loop are marked ``# accel:``. Synthetic data, no download.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import accel


def make_data(n: int, seed: int) -> TensorDataset:
    """Four classes: the label is the argmax of a fixed linear map of the input."""
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ w).argmax(dim=1))


def fold_indices(n: int, folds: int, fold: int) -> tuple[list[int], list[int]]:
    """Train and validation indices of ``fold`` (sample ``i`` validates in fold ``i % folds``)."""
    valid = [i for i in range(n) if i % folds == fold]
    train = [i for i in range(n) if i % folds != fold]
    return train, valid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-folds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    with accel.distributed(seed=0):
        dataset, test_set = make_data(300, 1), make_data(45, 2)
        test = accel.prepare_data_loader(DataLoader(test_set, batch_size=args.batch_size))
        test_logits: list[torch.Tensor] = []
        test_labels = torch.empty(0)
        for fold in range(args.num_folds):
            train_idx, valid_idx = fold_indices(len(dataset), args.num_folds, fold)
            accel.set_seed(fold)  # a different initialisation per fold, the same on all ranks
            model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            train = DataLoader(Subset(dataset, train_idx), batch_size=args.batch_size,
                               shuffle=True)
            valid = DataLoader(Subset(dataset, valid_idx), batch_size=args.batch_size)
            model, optimizer, train, valid = accel.prepare(model, optimizer, train, valid)
            for _ in range(args.epochs):
                model.train()
                for x, y in train:
                    loss = nn.functional.cross_entropy(model(x), y)
                    accel.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()

            model.eval()
            with torch.no_grad():
                correct = total = 0
                for x, y in valid:
                    predictions, labels = accel.gather_for_metrics((model(x).argmax(1), y))
                    correct += int((predictions == labels).sum())
                    total += labels.numel()
                accel.print(f"fold {fold}: validation accuracy {correct / total:.3f} "
                            f"({total} samples)")
                logits, labels = [], []
                for x, y in test:
                    lg, lb = accel.gather_for_metrics((model(x), y))  # accel: in sample order
                    logits.append(lg)
                    labels.append(lb)
            test_logits.append(torch.cat(logits))
            test_labels = torch.cat(labels)
            model, optimizer = accel.free_memory(model, optimizer)

        ensemble = torch.stack(test_logits).mean(dim=0).argmax(dim=1)
        accuracy = (ensemble == test_labels).float().mean().item()
        in_order = torch.equal(test_labels, test_set.tensors[1])
        accel.print(f"ensemble of {len(test_logits)} folds: test accuracy {accuracy:.3f} "
                    f"({test_labels.numel()} samples, labels in dataset order: {in_order})")


if __name__ == "__main__":
    main()

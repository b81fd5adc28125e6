"""The quicktour loop: train a linear classifier with accel on any number of processes.

Run on 2 CPU processes:      accel launch --nproc-per-node 2 examples/quicktour.py
Or on one process:           python examples/quicktour.py
Lines that differ from a plain PyTorch loop are marked ``# accel:``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import accel

IN_FEATURES, NUM_CLASSES = 10, 5


class RandomDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points labelled by a fixed random linear map (so there is something to learn)."""

    def __init__(self, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(length, IN_FEATURES, generator=g)
        teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=torch.Generator().manual_seed(0))
        self.y = (self.x @ teacher).argmax(dim=-1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]

    def __len__(self) -> int:
        return len(self.x)


def accuracy(predictions: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    return (torch.cat(predictions).argmax(-1) == torch.cat(targets)).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--data-len", type=int, default=10000)
    parser.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"])
    parser.add_argument("--output-dir", default="quicktour_output")
    args = parser.parse_args()

    # accel: one block sets up the process group, device and precision for everything inside
    with accel.distributed(mixed_precision=args.mixed_precision, seed=42):
        model = nn.Linear(IN_FEATURES, NUM_CLASSES)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999),
                                      weight_decay=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs,
                                                               eta_min=1e-4)
        loss_fn = nn.CrossEntropyLoss()
        train_loader = DataLoader(RandomDataset(args.data_len, seed=1),
                                  batch_size=args.batch_size, shuffle=True)
        val_loader = DataLoader(RandomDataset(args.data_len // 5, seed=2),
                                batch_size=args.batch_size)
        # accel: device placement, DDP, sharded loaders, accumulation-aware optimizer
        model, optimizer, train_loader, val_loader = accel.prepare(
            model, optimizer, train_loader, val_loader
        )
        for epoch in range(1, args.epochs + 1):
            model.train()
            predictions, targets, losses = [], [], []
            # accel: a progress bar on the main process only (plain iteration without tqdm)
            for x, y in accel.progress(train_loader, desc=f"{epoch}/{args.epochs} train"):
                with accel.autocast():  # accel: the state's mixed precision
                    logits = model(x)
                    loss = loss_fn(logits, y)
                optimizer.zero_grad()
                accel.backward(loss)  # accel: scales for fp16, divides for accumulation
                accel.clip_grad_norm_(model.parameters(), max_norm=1.0)
                optimizer.step()
                # accel: every rank's predictions, without the last batch's padding
                all_logits, all_y, all_loss = accel.gather_for_metrics(
                    (logits.detach(), y, loss.detach())
                )
                predictions.append(all_logits)
                targets.append(all_y)
                losses.append(all_loss)
            scheduler.step()
            train_acc = accuracy(predictions, targets)
            train_loss = torch.cat([loss.reshape(-1) for loss in losses]).mean().item()

            model.eval()
            predictions, targets = [], []
            for x, y in val_loader:
                with torch.inference_mode():
                    logits = model(x)
                all_logits, all_y = accel.gather_for_metrics((logits, y))
                predictions.append(all_logits)
                targets.append(all_y)
            val_acc = accuracy(predictions, targets)
            seen = sum(len(t) for t in targets)
            accel.print(  # accel: printed once per machine
                f"epoch {epoch}: train loss {train_loss:.4f} acc {train_acc:.4f} | "
                f"val acc {val_acc:.4f} on {seen} samples"
            )

        accel.wait_for_everyone()
        output = Path(args.output_dir)
        # accel: written once, by the main process, atomically; keys of the bare nn.Linear
        accel.save(accel.get_state_dict(model), output / "model.safetensors")
        accel.print(f"training finished; weights in {output / 'model.safetensors'}")


if __name__ == "__main__":
    main()

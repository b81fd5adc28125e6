"""The quicktour loop under DeepSpeed ZeRO-3, from a DeepSpeed JSON config, on CPU or GPUs.

Run on 2 CPU processes:      accel launch --nproc-per-node 2 examples/deepspeed.py
Lines that differ from the quicktour (examples/quicktour.py) are marked ``# deepspeed:``.

Each process holds half of every parameter, gradient and AdamW moment (ZeRO stage 3). The
loop is the one written for DDP or FSDP2; at the end the full weights are written with
``save_model`` and the training state with ``save_state``, a checkpoint one plain process (or
FSDP2, or another ZeRO stage) resumes from.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import accel

# This file is named deepspeed.py, and Python puts a script's folder first on sys.path: without
# this line `import deepspeed` (inside accel.prepare) would find this file, not the package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(
    os.path.abspath(__file__))]

IN_FEATURES, HIDDEN, NUM_CLASSES = 10, 32, 5

# deepspeed: the user's own DeepSpeed config; "auto" is filled from accel's settings
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


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
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--data-len", type=int, default=2000)
    parser.add_argument("--output-dir", default="deepspeed_output")
    args = parser.parse_args()

    # deepspeed: strategy and config; the rest of the loop is unchanged
    with accel.distributed(strategy="deepspeed", deepspeed_config=ZERO3, seed=42):
        model = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(),
                              nn.Linear(HIDDEN, NUM_CLASSES))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
        loss_fn = nn.CrossEntropyLoss()
        train_loader = DataLoader(RandomDataset(args.data_len, seed=1),
                                  batch_size=args.batch_size, shuffle=True)
        val_loader = DataLoader(RandomDataset(args.data_len // 5, seed=2),
                                batch_size=args.batch_size)
        # deepspeed: the model comes back as the DeepSpeed engine (call it like the model)
        model, optimizer, train_loader, val_loader = accel.prepare(
            model, optimizer, train_loader, val_loader
        )
        for epoch in range(1, args.epochs + 1):
            model.train()
            losses = []
            for x, y in accel.progress(train_loader, desc=f"{epoch}/{args.epochs} train"):
                loss = loss_fn(model(x), y)
                accel.backward(loss)  # the engine's backward
                accel.clip_grad_norm_(model.parameters(), max_norm=1.0)  # the config's value
                optimizer.step()  # the engine's step
                optimizer.zero_grad()
                losses.append(accel.gather_for_metrics(loss.detach()))
            train_loss = torch.cat([loss.reshape(-1) for loss in losses]).mean().item()

            model.eval()
            predictions, targets = [], []
            for x, y in val_loader:
                with torch.no_grad():
                    logits = model(x)
                all_logits, all_y = accel.gather_for_metrics((logits, y))
                predictions.append(all_logits)
                targets.append(all_y)
            accel.print(f"epoch {epoch}: train loss {train_loss:.4f} | "
                        f"val acc {accuracy(predictions, targets):.4f}")

        output = Path(args.output_dir)
        accel.save_model(model, output / "weights")  # full weights (every rank gathers)
        # the plain format: fp32 master weights and AdamW state by parameter name
        accel.save_state(output / "state", model=model, optimizer=optimizer)
        accel.print(f"training finished; weights in {output / 'weights'}, "
                    f"state in {output / 'state'}")


if __name__ == "__main__":
    main()

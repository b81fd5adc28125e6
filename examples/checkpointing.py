"""Checkpointing: save the full training state every few steps, keep the newest three.

Run: accel launch --nproc-per-node 2 examples/checkpointing.py   (or python examples/...)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="checkpoints")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    with accel.distributed(seed=0):
        data = TensorDataset(torch.randn(512, 10), torch.randint(0, 5, (512,)))
        model = nn.Linear(10, 5)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
        loader = DataLoader(data, batch_size=32, shuffle=True)
        model, optimizer, loader, scheduler = accel.prepare(model, optimizer, loader, scheduler)
        step = 0
        for _ in range(args.epochs):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if step % 4 == 0:  # accel: every rank calls save_state
                    path = accel.save_state(
                        args.output_dir, step=step, total_limit=3,
                        model=model, optimizer=optimizer, scheduler=scheduler,
                        train_loader=loader,
                    )
                    accel.print(f"step {step}: saved {path}")
            scheduler.step()
        accel.save_model(model, f"{args.output_dir}/final")  # accel: HF layout, bare keys
        accel.print("latest:", accel.latest_checkpoint(args.output_dir))


if __name__ == "__main__":
    main()

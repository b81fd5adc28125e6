"""Auto-resume: rerun the same command after a crash and training continues exactly.

Run: accel launch --nproc-per-node 2 examples/resume.py --output-dir runs/demo
Kill it (Ctrl-C) and run it again: it picks up from the newest complete checkpoint, in the
middle of an epoch, without replaying the batches already seen.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="resume_run")
    parser.add_argument("--total-steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5)
    args = parser.parse_args()
    with accel.distributed(seed=0, gradient_accumulation_steps=2):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(400, 10, generator=g), torch.randn(400, 1, generator=g))
        model = nn.Sequential(nn.Linear(10, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(data, batch_size=16, shuffle=True)
        model, optimizer, loader = accel.prepare(model, optimizer, loader)
        objects = {"model": model, "optimizer": optimizer, "train_loader": loader}
        # accel: one line of auto-resume
        info = accel.load_state(args.output_dir, missing_ok=True, **objects)
        step = info.step if info else 0
        accel.print("starting at step", step)
        while step < args.total_steps:
            for x, y in loader:
                with accel.accumulate(model):
                    accel.backward(nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                step += 1
                if step % args.save_every == 0:
                    accel.save_state(args.output_dir, step=step, total_limit=2, **objects)
                if step >= args.total_steps:
                    break
        accel.print("finished at step", step)


if __name__ == "__main__":
    main()

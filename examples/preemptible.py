"""Preemptible training: save and exit 0 when the scheduler asks, resume on the next run.

Run: accel launch --nproc-per-node 2 examples/preemptible.py --output-dir runs/demo
Send SIGTERM (or SIGINT, SIGUSR1) to `accel launch` (Ctrl-C does it too): it passes the signal to
every worker, all ranks see `accel.stop_requested()` turn True at the same step, save a
checkpoint and exit 0, and so does the launcher. Run the same command again: it resumes from
that checkpoint, and the final weights are exactly those of a run that was never stopped.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="preemptible_run")
    parser.add_argument("--total-steps", type=int, default=60)
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds to sleep per step (stands in for a longer step)")
    args = parser.parse_args()
    root = Path(args.output_dir)
    with accel.distributed(seed=0):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(400, 10, generator=g), torch.randn(400, 1, generator=g))
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(data, batch_size=16, shuffle=True)
        model, optimizer, loader = accel.prepare(model, optimizer, loader)
        objects = {"model": model, "optimizer": optimizer, "train_loader": loader}
        # accel: resume from the newest checkpoint, if any
        info = accel.load_state(root / "checkpoints", missing_ok=True, **objects)
        step = info.step if info else 0
        accel.print(f"starting at step {step}", flush=True)
        stopped = False
        while step < args.total_steps and not stopped:
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                accel.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                accel.print(f"step {step}", flush=True)
                time.sleep(args.step_delay)
                if step >= args.total_steps:
                    break
                # accel: every rank gets the same answer at the same step
                if accel.stop_requested():
                    accel.save_state(root / "checkpoints", step=step, total_limit=2, **objects)
                    accel.print(f"stop requested: saved step {step}, exiting", flush=True)
                    stopped = True
                    break
        if not stopped:
            accel.save_model(model, root / "final")
            accel.print(f"finished at step {step}", flush=True)


if __name__ == "__main__":
    main()

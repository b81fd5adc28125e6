"""Checkpointing: save the whole training state during the run, and resume from it exactly.

Run on 2 CPU processes, saving every 5 optimizer steps (or ``--checkpointing-steps epoch``):

    accel launch --nproc-per-node 2 --cpu examples/by_feature/checkpointing.py \
        --output-dir ckpt --checkpointing-steps 5 --final-weights full.safetensors

then resume from one of those checkpoints (``ckpt`` alone picks the newest complete one):

    accel launch --nproc-per-node 2 --cpu examples/by_feature/checkpointing.py \
        --output-dir ckpt2 --resume-from-checkpoint ckpt/checkpoint_5 \
        --final-weights resumed.safetensors

``full.safetensors`` and ``resumed.safetensors`` hold the same weights, bit for bit: the
checkpoint holds the model, optimizer, scheduler, the loader's position (mid-epoch) and every
rank's RNG states (the model uses dropout). Lines that differ from a plain loop are marked
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default="checkpoints")
    parser.add_argument("--checkpointing-steps", default="epoch",
                        help="an integer (every N optimizer steps) or 'epoch'")
    parser.add_argument("--resume-from-checkpoint", default=None,
                        help="a checkpoint directory, or a root holding checkpoint_N folders")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--final-weights", default=None, help="write the final weights here")
    args = parser.parse_args()
    every = None if args.checkpointing_steps == "epoch" else int(args.checkpointing_steps)

    with accel.distributed(seed=42):
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train = DataLoader(make_data(192, 1), batch_size=8, shuffle=True)
        valid = DataLoader(make_data(64, 2), batch_size=16)
        scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.epochs * len(train)
        )
        model, optimizer, train, valid, scheduler = accel.prepare(
            model, optimizer, train, valid, scheduler
        )
        # accel: objects are named; the same names save and load them
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                   "train_loader": train}

        completed_steps = 0
        if args.resume_from_checkpoint:  # accel: every rank loads; the loader resumes mid-epoch
            info = accel.load_state(args.resume_from_checkpoint, **objects)
            completed_steps = info.step or 0
            accel.print(f"resumed from {info.path.name} at step {completed_steps}")
        start_epoch = train.epoch  # accel: the loader's position says which epoch to continue

        for epoch in range(start_epoch, args.epochs):
            model.train()
            for x, y in train:  # after a resume: only the batches not yet seen this epoch
                loss = nn.functional.cross_entropy(model(x), y)
                accel.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                if every is not None and completed_steps % every == 0:
                    # accel: every rank calls it; written to output_dir/checkpoint_<step>
                    accel.save_state(args.output_dir, step=completed_steps, **objects)
            if every is None:
                accel.save_state(args.output_dir, step=completed_steps, **objects)

            model.eval()
            correct = total = 0
            with torch.no_grad():
                for x, y in valid:
                    predictions, labels = accel.gather_for_metrics((model(x).argmax(1), y))
                    correct += int((predictions == labels).sum())
                    total += labels.numel()
            accel.print(f"epoch {epoch}: accuracy {correct / total:.3f} ({total} samples)")

        if args.final_weights:  # accel: written once, by the main process
            accel.save(accel.get_state_dict(model), args.final_weights)
        accel.print(f"finished at step {completed_steps}; "
                    f"latest checkpoint: {accel.latest_checkpoint(args.output_dir)}")


if __name__ == "__main__":
    main()

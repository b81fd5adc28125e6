"""Save a trained model, load it with plain torch, then run it within a memory budget.

The two flows of Accelerate's docs, written with accel:

1. After training, the main process saves the unwrapped model's state dict with
   ``accel.save``. The file is in torch's format, so another script loads it with plain
   ``torch.load``.
2. Big-model inference: build the model on ``meta`` with ``accel.init_empty_weights()`` (no
   memory is allocated and nothing is initialised). Then ``accel.load_checkpoint_and_dispatch``
   streams the checkpoint into it by a device map. Given a ``max_memory`` budget smaller than
   the model, the blocks that do not fit go to ``offload_folder`` and are memory-mapped from
   disk. Each one is read in for its own forward.

Every process scores its own share of the inputs with its own copy of the model. With the
safetensors shards that ``accel.save_model`` writes, offloaded weights are mapped in place
instead of being copied to ``offload_folder``.

Run on 2 CPU processes:      accel launch --nproc-per-node 2 examples/big_model_inference.py
Or on one process:           python examples/big_model_inference.py
Lines that differ from plain PyTorch are marked ``# accel:``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel

FEATURES = 16


class Block(nn.Module):
    """A residual MLP block: the unit a device map keeps whole (``no_split_module_classes``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.fc2(torch.relu(self.fc1(self.norm(x))))
        return x + update


class CriticModel(nn.Module):
    """Scores a feature vector: an input layer, a stack of blocks, a scalar head."""

    def __init__(self, width: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score: torch.Tensor = self.head(self.blocks(self.embed(x)))
        return score.squeeze(-1)


def train(args: argparse.Namespace) -> nn.Module:
    """A few epochs of regression on random data; returns the trained, unwrapped model."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, FEATURES, generator=g)
    y = torch.tanh(x[:, : FEATURES // 2].sum(-1) - x[:, FEATURES // 2 :].sum(-1))
    model = CriticModel(args.width, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)  # accel: DDP, shards
    for epoch in range(args.epochs):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            accel.backward(loss)  # accel
            optimizer.step()
        accel.print(f"epoch {epoch}: loss {loss.item():.4f}")  # accel: once per machine
    return accel.unwrap_model(model)  # accel: the user's own module, without DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="big_model_output")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--max-cpu-memory", default="400KB",
                        help="max_memory['cpu'] of the offloaded run: less than the model")
    args = parser.parse_args()
    output = Path(args.output_dir)

    with accel.distributed(seed=42):  # accel: process group, device and seed for the block
        trained = train(args)
        trained.eval()
        nbytes = sum(p.numel() * p.element_size() for p in trained.parameters())

        # Flow 1: save once, load with plain torch.
        accel.wait_for_everyone()  # accel: every rank has finished training
        checkpoint = output / "critic"
        # accel: written by the main process only, atomically; torch's format (no .safetensors)
        accel.save(trained.state_dict(), checkpoint)
        accel.wait_for_everyone()  # accel: the other ranks read the file below
        restored = CriticModel(args.width, args.depth)
        restored.load_state_dict(torch.load(checkpoint))  # plain torch, weights_only=True
        restored.eval()

        inputs = torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(1))
        # accel: this rank's share of the inputs (the first ranks get one more if uneven)
        with accel.split_between_processes(inputs) as mine, torch.no_grad():
            expected = trained(mine)
            assert torch.equal(restored(mine), expected), "torch.load gave other weights"
            accel.print(f"flow 1: {checkpoint} ({nbytes} bytes of weights) loads with "
                        "torch.load; outputs equal")

            # Flow 2a, as in Accelerate's docs: everything fits in RAM.
            with accel.init_empty_weights():  # accel: parameters on meta, nothing allocated
                critic: nn.Module = CriticModel(args.width, args.depth)
                critic = accel.load_checkpoint_and_dispatch(  # accel
                    critic, checkpoint=checkpoint, device_map="auto"
                )
            torch.testing.assert_close(critic(mine), expected, atol=1e-6, rtol=0)
            accel.print(f"flow 2 in RAM: hf_device_map {critic.hf_device_map}")

            # Flow 2b: a budget smaller than the model: the blocks that do not fit run from
            # disk. Each rank offloads into a folder of its own (no two ranks write one file).
            with accel.init_empty_weights():  # accel
                critic = CriticModel(args.width, args.depth)
            offload = output / f"offload-rank{accel.state().rank}"  # accel: this rank's number
            critic = accel.load_checkpoint_and_dispatch(  # accel
                critic,
                checkpoint=checkpoint,
                device_map="auto",
                max_memory={"cpu": args.max_cpu_memory},
                offload_folder=offload,
                no_split_module_classes=[Block],  # whole blocks (classes or their names)
            )
            got = critic(mine)
            diff = (got - expected).abs().max()
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
            # accel: the placement, {submodule name: "cpu" | "disk" | GPU index}
            device_map = cast("dict[str, str | int]", critic.hf_device_map)
            on_disk = [name for name, where in device_map.items() if where == "disk"]
            accel.print(f"flow 2 with max_memory={{'cpu': {args.max_cpu_memory!r}}} for "
                        f"{nbytes} bytes: hf_device_map {device_map}")
            accel.print(f"run from disk ({offload}): {on_disk}")
        # accel: every rank's largest difference, in rank order
        diffs = accel.gather(diff.reshape(1))
        accel.print(f"big-model outputs match the fully loaded model on {len(diffs)} "
                    f"process(es): max abs diff per rank {diffs.tolist()}")


if __name__ == "__main__":
    main()

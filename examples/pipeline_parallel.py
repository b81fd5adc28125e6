"""Pipeline parallelism: a stack of blocks split into stages over 2 processes, trained and saved.

Run on 2 CPU processes, one pipeline stage each (the embedding and the first blocks on rank 0,
the last blocks and the head on rank 1):

    accel launch --nproc-per-node 2 --cpu --pp-size 2 examples/pipeline_parallel.py \
        --schedule 1F1B --microbatches 4 --save-dir /tmp/pp_ckpt

Any of torch's schedules works (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``,
``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``); the interleaved and V schedules
run 2 stages per rank. Without ``--pp-size`` (or on one process) the same script trains the
model unsplit and prints the same losses. The checkpoint resumes on any pipeline layout or on
one process (``--resume``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import accel


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class TinyLM(nn.Module):
    """Embedding, blocks, norm and head: the chain ``pp_plan="auto"`` splits evenly."""

    def __init__(self, vocab: int = 32, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (a mean per microbatch)."""
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--save-dir")
    parser.add_argument("--resume")
    args = parser.parse_args()
    with accel.distributed(seed=0) as st:
        model = TinyLM()
        # accel: split into this rank's stage(s); the schedule runs them
        model = accel.prepare_model(model, pp_plan="auto", pp_schedule=args.schedule,
                                    microbatches=args.microbatches)
        optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
        if args.resume:
            accel.load_state(args.resume, model=model, optimizer=optimizer)
        accel.print(f"pp stages: {st.pp_world_size}, this rank: {st.pp_rank}, "
                    f"{sum(p.numel() for p in model.parameters())} parameters here")
        data = torch.Generator().manual_seed(1)
        for step in range(args.steps):
            tokens = torch.randint(0, 32, (args.batch_size, 16), generator=data)
            # accel: every rank calls it; the first stage reads tokens, the last the labels
            loss = accel.pipeline_step(model, tokens, tokens, loss_fn=lm_loss)
            accel.clip_grad_norm_(model.parameters(), 1.0)  # the norm over every stage
            optimizer.step()
            optimizer.zero_grad()
            accel.print(f"step {step} loss {loss.item():.5f}")
        if args.save_dir:
            accel.save_state(args.save_dir, model=model, optimizer=optimizer)


if __name__ == "__main__":
    main()

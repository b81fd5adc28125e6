"""FSDP2: train a small transformer language model sharded across processes, save, resume on more.

Run:
    accel launch --nproc-per-node 2 examples/fsdp.py --output-dir fsdp_run --save-at 6
    accel launch --nproc-per-node 3 examples/fsdp.py --output-dir fsdp_run --resume --steps 12

The first command trains on 2 processes, each holding half of every parameter, gradient and
AdamW moment, and writes a sharded checkpoint (each rank its own shards) at step 6, plus the
full weights with ``save_model``. The second loads that checkpoint on 3 processes (the shards
are re-cut for 3) and continues with the next batches (a warning says that the per-process
random number generator states are not restored at another number of processes). Both print
the loss of every step and the loss on a fixed evaluation batch.

The data are synthetic token sequences that follow a simple rule (each token determines the
next one, with some noise), so the loss goes down within a few steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import accel

VOCAB = 32
DIM = 32
HEADS = 2
LAYERS = 2
SEQ = 16


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, ``LAYERS`` blocks, a final norm and the output head.

    The logits come back flattened to ``(batch * length, VOCAB)``, the shape the loss takes (a
    reshaped view as the output of an FSDP root module would make torch warn).
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: predict ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits, tokens[:, 1:].reshape(-1))


def make_tokens(count: int, seed: int) -> torch.Tensor:
    """``count`` sequences of ``SEQ + 1`` tokens: next = (5 * token + 3) % VOCAB, 10% noise."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(count, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (count,), generator=g)
    for t in range(SEQ):
        rule = (5 * tokens[:, t] + 3) % VOCAB
        noise = torch.randint(0, VOCAB, (count,), generator=g)
        tokens[:, t + 1] = torch.where(torch.rand(count, generator=g) < 0.1, noise, rule)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="fsdp_run")
    parser.add_argument("--steps", type=int, default=6, help="train until this step")
    parser.add_argument("--save-at", type=int, default=None, help="save_state at this step")
    parser.add_argument("--resume", action="store_true", help="load the newest checkpoint")
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    args = parser.parse_args()
    out = Path(args.output_dir)
    with accel.distributed(strategy="fsdp", seed=0):  # accel: FSDP2 for every prepared model
        model = accel.prepare_model(TinyLM(), shard_modules=Block)  # accel: shards each Block
        # accel: create the optimizer after prepare_model, over the sharded parameters
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        # Not shuffled, so the batches each step sees can be checked; shuffle=True works too.
        loader = DataLoader(TensorDataset(make_tokens(192, seed=0)), batch_size=args.batch_size)
        optimizer, loader = accel.prepare(optimizer, loader)
        objects = {"model": model, "optimizer": optimizer, "train_loader": loader}
        eval_tokens = make_tokens(16, seed=1)  # the same fixed batch on every process

        step = 0
        if args.resume:  # accel: the shards are re-cut for this number of processes
            info = accel.load_state(out / "checkpoints", **objects)
            step = info.step or 0
            accel.print(f"resumed from step {step} (saved on {info.world_size} processes, "
                        f"running on {accel.state().world_size})")
        while step < args.steps:
            for (tokens,) in loader:
                loss = lm_loss(model, tokens)
                accel.backward(loss)
                accel.clip_grad_norm_(model.parameters(), 1.0)  # global norm over all shards
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                mean = accel.reduce(loss.detach(), "mean")  # every process calls it
                accel.print(f"step {step} loss {mean.item():.6f}")
                if step == args.save_at:  # accel: every rank writes its own shards
                    path = accel.save_state(out / "checkpoints", step=step, **objects)
                    accel.save_model(model, out / "model")  # full weights, HF layout
                    accel.print(f"saved {path} and full weights in {out / 'model'}")
                if step >= args.steps:
                    break
        with torch.no_grad():
            eval_loss = lm_loss(model, eval_tokens).item()
        accel.print(f"eval loss {eval_loss:.6f} at step {step}")


if __name__ == "__main__":
    main()

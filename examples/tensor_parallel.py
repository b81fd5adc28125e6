"""Tensor parallel x FSDP on a 2 x 2 mesh: a small transformer-style model, trained and saved.

Run on 4 CPU processes, tensor parallel over pairs of ranks and FSDP across the pairs:

    accel launch --nproc-per-node 4 --cpu --tp-size 2 --dp-shard-size 2 \
        examples/tensor_parallel.py --save-dir /tmp/tp_ckpt

(any other mesh works too: `--tp-size 4`, `--dp-replicate-size 2 --dp-shard-size 2`, or no
sizes at all for plain DDP). Each block's MLP is split column-wise then row-wise over the
``tp`` ranks (one all-reduce per block), the attention projections likewise, and FSDP shards
the result over the data-parallel ranks. The checkpoint written at the end resumes on any
mesh, or in a plain single-process model (``--resume``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel

WIDTH, HEADS, VOCAB, SEQ = 64, 4, 128, 16

# module-name patterns (`*` = one name part) -> how the layer is split over the tp ranks
PLAN = {
    "blocks.*.attn.q": "colwise",  # each rank computes its heads' queries, keys, values
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",  # ... and its share of the output, summed across ranks
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
}


class Attention(nn.Module):
    """Separate q, k, v projections: split column-wise, each rank holds whole heads. (One fused
    qkv Linear would not do: its column split would give rank 0 all of q and half of k.)"""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(proj: nn.Module) -> torch.Tensor:  # -1: the heads this rank holds
            return proj(x).view(batch, length, -1, WIDTH // HEADS).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(
            heads(self.q), heads(self.k), heads(self.v), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.norm2, self.mlp = nn.LayerNorm(WIDTH), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class TinyLM(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def corpus(samples: int = 64) -> TensorDataset:
    """Sequences that count up modulo the vocabulary from a random start: learnable."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (samples, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--save-dir", default=None)
    parser.add_argument("--resume", default=None, help="a checkpoint written by --save-dir")
    args = parser.parse_args()

    with accel.distributed(seed=0) as st:
        model = accel.prepare_model(TinyLM(), tp_plan=PLAN)
        optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
        if args.resume:
            accel.load_state(args.resume, model=model, optimizer=optimizer)
        loader = accel.prepare_data_loader(
            DataLoader(corpus(), batch_size=args.batch_size, shuffle=True), split_batches=True
        )
        accel.print(f"mesh (pp, dp_replicate, dp_shard, cp, tp) = {st.mesh_shape}, "
                    f"{st.world_size} processes")
        step = 0
        while step < args.steps:
            for tokens, targets in loader:
                logits = model(tokens)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                accel.backward(loss)
                norm = accel.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                mean = accel.reduce(loss.detach(), reduction="mean")
                accel.print(f"step {step} loss {mean.item():.4f} grad_norm {norm.item():.4f}")
                if step == args.steps:
                    break
        if args.save_dir:
            accel.save_state(args.save_dir, model=model, optimizer=optimizer)
            accel.print(f"saved {args.save_dir}")


if __name__ == "__main__":
    main()

"""Small language models with tied input/output embeddings, for checkpoint tests.

``TiedLM`` needs only torch; :func:`gpt2` builds a transformers GPT-2 from a tiny config
(nothing downloaded). Both tie the output projection to the token embedding, as GPT-2,
Llama-3.2 1B/3B, Gemma and small Qwen models do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 37
WIDTH = 13  # odd: uneven FSDP shards on 2 and 3 ranks
SEQ = 6
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.lin(x)))


class TiedLM(nn.Module):
    """Embedding -> blocks -> head, the head's weight the embedding's unless ``tie=False``."""

    def __init__(self, tie: bool = True, head_first: bool = False) -> None:
        super().__init__()
        if head_first:  # registered first: the head's name comes first in state_dict()
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        if not head_first:
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def toy(seed: int = 0, tie: bool = True, head_first: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return TiedLM(tie=tie, head_first=head_first)


def gpt2(seed: int = 0, tie: bool = True) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=tie, use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"toy": toy, "gpt2": gpt2}


def tokens(index: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """This rank's rows of the global batch ``index`` (each rank an equal slice)."""
    generator = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
    per = GLOBAL_BATCH // world_size
    return ids[rank * per : (rank + 1) * per]


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out: Any = model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)
    )

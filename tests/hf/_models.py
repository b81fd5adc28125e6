"""Tiny transformers (and peft) models for the real-model matrix, built from configs.

Nothing is downloaded: every model is made from a small config (2 layers, hidden size 32, a
vocabulary of 96) with a fixed seed, dropout off and eager attention, so that two builds with
the same seed are the same model. The data are fixed too: global batch ``index`` is the same
tensors on every rank and every world size, and each rank takes its equal slice of the rows,
so a run on 1, 2 or 3 processes computes the same steps.

Families (``FAMILIES``), each chosen for what it exercises:

- ``gpt2``: tied input embedding and head, ``Conv1D`` layers, learned positions;
- ``llama_tied`` / ``llama``: RoPE, grouped-query attention (2 key/value heads for 4 query
  heads), with ``tie_word_embeddings`` on and off;
- ``bert``: an encoder with a sequence classification head (labels per sequence);
- ``t5``: encoder-decoder whose encoder, decoder and head share one embedding;
- ``mixtral``: Mixture of Experts (4 experts, top 2; fused expert weights in transformers 5);
- ``llama_lora``: peft LoRA (q_proj, v_proj) on the tied Llama: frozen base, trainable adapters.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import accel

VOCAB = 96
SEQ = 8
TARGET_SEQ = 6  # t5 labels
GLOBAL_BATCH = 12  # divides by 1, 2, 3, and by 2 again for accumulation on 2 ranks
LABELS = 3  # bert classes
PAD, BOS, EOS = 0, 1, 2  # special tokens inside the tiny vocabulary
CLIP = 1.0  # max gradient norm
LR = 2e-3  # AdamW: an update's rounding error scales with it; 3 steps still move weights ~5e-3

FAMILIES = ("gpt2", "llama_tied", "llama", "bert", "t5", "mixtral", "llama_lora")
# What the worker processes of these tests import: the warm server imports it once instead
# (the ``preload`` mark, tests/conftest.py); ~5-8 s a process on the 2-core machine otherwise.
PRELOAD = ("transformers", "peft", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert",
           "transformers.models.t5.modeling_t5", "transformers.models.mixtral.modeling_mixtral")


def quiet_transformers() -> None:
    """Silence transformers' info/warning logging (config notes, loss-type notes)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _special() -> dict[str, Any]:
    return {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS}


def _llama_config(tied: bool) -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, use_cache=False, **_special(),
    )


def config(family: str) -> Any:
    """The family's tiny config (eager attention, no dropout, no cache while training)."""
    import transformers

    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, **_special(),
        )
    elif family in ("llama_tied", "llama_lora"):
        cfg = _llama_config(tied=True)
    elif family == "llama":
        cfg = _llama_config(tied=False)
    elif family == "bert":
        cfg = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, num_labels=LABELS,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD,
        )
    elif family == "t5":
        cfg = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=PAD, pad_token_id=PAD,
            eos_token_id=EOS, use_cache=False,
        )
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
            **_special(),
        )
    else:
        raise KeyError(f"unknown family {family!r}; known: {FAMILIES}")
    cfg._attn_implementation = "eager"
    return cfg


def model_class(family: str) -> Any:
    """The transformers class whose ``from_pretrained`` reads the family's weights."""
    import transformers

    return {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama_tied": transformers.LlamaForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "llama_lora": transformers.LlamaForCausalLM,
        "bert": transformers.BertForSequenceClassification,
        "t5": transformers.T5ForConditionalGeneration,
        "mixtral": transformers.MixtralForCausalLM,
    }[family]


def lora(base: nn.Module) -> nn.Module:
    """LoRA adapters (rank 4) on the attention's q and v projections of a Llama."""
    import peft

    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, cfg)


def build(family: str, seed: int = 0) -> nn.Module:
    """A fresh model of the family, the same for the same seed, in training mode."""
    quiet_transformers()
    torch.manual_seed(seed)
    model: nn.Module = model_class(family)(config(family))
    if family == "llama_lora":
        model = lora(model)
    model.train()
    return model


def batch(
    family: str, index: int, rank: int = 0, world_size: int = 1, part: tuple[int, int] = (0, 1)
) -> dict[str, torch.Tensor]:
    """This rank's rows of global batch ``index``; ``part=(i, n)``: the i-th of n micro-batches."""
    generator = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(3, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
    full: dict[str, torch.Tensor]
    if family == "bert":
        labels = torch.randint(0, LABELS, (GLOBAL_BATCH,), generator=generator)
        full = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    elif family == "t5":
        target = torch.randint(3, VOCAB, (GLOBAL_BATCH, TARGET_SEQ), generator=generator)
        full = {"input_ids": ids, "labels": target}
    else:
        full = {"input_ids": ids, "labels": ids}
    per_rank = GLOBAL_BATCH // world_size
    i, n = part
    per_part = per_rank // n
    start = rank * per_rank + i * per_part
    return {k: v[start : start + per_part] for k, v in full.items()}


def probe(family: str) -> dict[str, torch.Tensor]:
    """A fixed input (2 rows) whose logits the save/load checks compare."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=generator)
    if family == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    return {"input_ids": ids}


@torch.no_grad()
def logits(model: nn.Module, family: str) -> torch.Tensor:
    was_training = model.training
    model.eval()
    out = model(**probe(family)).logits.float()
    model.train(was_training)
    return out


GENERATIVE = tuple(f for f in FAMILIES if f != "bert")
NEW_TOKENS = 5


@torch.no_grad()
def generate(model: nn.Module, family: str) -> torch.Tensor:
    """Greedy ``generate()`` from the probe's input ids, with the KV cache."""
    was_training = model.training
    model.eval()
    out: torch.Tensor = model.generate(  # type: ignore[operator]
        input_ids=probe(family)["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False,
        pad_token_id=PAD, use_cache=True,
    )
    model.train(was_training)
    return out


def loss(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    out: torch.Tensor = model(**data).loss
    return out


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (eps large enough that rounding noise in a
    gradient that is zero in exact arithmetic, e.g. an attention key bias, stays small)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR, eps=1e-6)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights (gathered under FSDP: every rank calls it), as copies."""
    return {k: v.detach().clone().float() for k, v in accel.get_state_dict(model).items()}


def schedule(opt: Any) -> Any:
    """transformers' linear schedule with warmup (its state must survive save/load)."""
    import transformers

    return transformers.get_linear_schedule_with_warmup(opt, 1, 10)


def step(
    model: nn.Module, opt: Any, family: str, index: int, *, micro: int = 1,
    scheduler: Any = None, norms: list[float] | None = None,
) -> float:
    """One optimizer step on global batch ``index`` (``micro`` accumulated micro-batches per
    rank, under ``accel.accumulate``), the gradient clipped to norm 1 (its norm before
    clipping appended to ``norms``); returns the global mean loss (a collective)."""
    st = accel.state()
    total = torch.zeros(())
    for i in range(micro):
        data = batch(family, index, st.rank, st.world_size, part=(i, micro))
        with accel.accumulate(model) as sync:
            value = loss(model, data)
            accel.backward(value)
            if sync:
                norm = accel.clip_grad_norm_(model.parameters(), CLIP)
                if norms is not None:
                    norms.append(float(norm))
            opt.step()
            if scheduler is not None:
                scheduler.step()
            opt.zero_grad()
        total += value.detach().float() / micro
    return float(accel.reduce(total, "mean"))


def train(
    model: nn.Module, opt: Any, family: str, steps: range, *, micro: int = 1,
    scheduler: Any = None, norms: list[float] | None = None,
) -> list[float]:
    """Steps over global batches ``steps``; their global losses."""
    return [
        step(model, opt, family, i, micro=micro, scheduler=scheduler, norms=norms)
        for i in steps
    ]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def blocks(family: str) -> list[str]:
    """The names of the model's transformer blocks, in order (for device maps)."""
    prefix = {
        "gpt2": ["transformer.h"],
        "llama_tied": ["model.layers"],
        "llama": ["model.layers"],
        "llama_lora": ["model.layers"],
        "bert": ["bert.encoder.layer"],
        "t5": ["encoder.block", "decoder.block"],
        "mixtral": ["model.layers"],
    }[family]
    return [f"{p}.{i}" for p in prefix for i in range(2)]


def first_layer(model: nn.Module, family: str) -> nn.Module:
    """The first module holding parameters inside the first block (through peft's wrapper).

    Gradient checkpointing recomputes the block's ``forward`` in the backward, which calls
    this module again (the block's own hooks run once: transformers 5 checkpoints
    ``forward``, not ``__call__``).
    """
    prefix = "base_model.model." if family == "llama_lora" else ""
    block = model.get_submodule(prefix + blocks(family)[0])
    return next(m for m in block.modules() if m is not block and m._parameters)


def device_map(family: str) -> dict[str, str]:
    """Everything on the CPU except the second block of each stack, which runs from disk."""
    return {"": "cpu", **{name: "disk" for name in blocks(family) if name.endswith(".1")}}


def fresh_dir(path: str | os.PathLike[str]) -> str:
    os.makedirs(path, exist_ok=True)
    return os.fspath(path)

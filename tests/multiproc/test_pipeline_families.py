"""Transformers families whose forward the pipeline split must follow exactly, on 2 stages
(``pp_plan="auto"``), equal one process running the same microbatches:

- OPT registers its final layer norm before its layers (units follow the traced forward);
- Bloom's blocks return tuples whose ``[0]`` the forward reads (tuple pass-throughs);
- Gemma-2 scales the embeddings and soft-caps the logits inside the forward (each stage gets
  exactly what the previous one sent, and returns its last block's output).

Before the traced split, OPT and Gemma-2 trained silently wrong and Bloom failed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers not installed"),
    pytest.mark.preload("transformers", "transformers.models.opt.modeling_opt",
                        "transformers.models.bloom.modeling_bloom",
                        "transformers.models.gemma2.modeling_gemma2"),
]

VOCAB, MICRO = 64, 2


def _model(family: str) -> nn.Module:
    import transformers as t

    torch.manual_seed(0)
    if family == "opt":
        config: Any = t.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, ffn_dim=64, max_position_embeddings=32,
                                  word_embed_proj_dim=32, dropout=0.0)
    elif family == "bloom":
        config = t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                               hidden_dropout=0.0, attention_dropout=0.0)
    else:
        config = t.Gemma2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                intermediate_size=64, max_position_embeddings=32)
    return t.AutoModelForCausalLM.from_config(config)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def _train(family: str) -> dict[str, Any]:
    """2 AdamW steps of 4 sequences each: pipelined in 2 microbatches, or (one process) the
    same 2 microbatches accumulated."""
    pipelined = accel.state().pp_world_size > 1
    model = _model(family)
    model = accel.prepare_model(model, pp_plan="auto", microbatches=MICRO) if pipelined \
        else accel.prepare_model(model)
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    ids = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(2):
        batch = ids[4 * step:4 * step + 4]
        if pipelined:
            losses.append(float(accel.pipeline_step(model, batch, batch, loss_fn=_loss)))
        else:
            total = 0.0
            for chunk in batch.chunk(MICRO):
                loss = _loss(model(chunk).logits, chunk) / MICRO
                loss.backward()
                total += float(loss)
            losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "weights": accel.get_state_dict(model)}


@pytest.mark.parametrize("family", ["opt", "bloom", "gemma2"])
def test_a_family_the_split_must_follow_equals_one_process(family: str) -> None:
    one = run_distributed(_train, family, world_size=1, timeout=120)[0]
    two = run_distributed(_train, family, world_size=2, timeout=120, pp_size=2)
    for out in two:
        assert out["losses"] == pytest.approx(one["losses"], abs=1e-6)
        assert out["weights"].keys() == one["weights"].keys()
        for name, value in one["weights"].items():
            if name.endswith("k_proj.bias"):
                # a key bias adds the same score to every key: softmax cancels it, its gradient
                # is rounding noise (~1e-9) that AdamW turns into lr-sized steps either way
                continue
            torch.testing.assert_close(out["weights"][name], value, atol=1e-6, rtol=1e-6,
                                       msg=name)

"""The traced forward the pipeline split relies on: the order the forward calls its modules
(OPT registers its final norm before its layers) and which return tuples (Bloom's blocks), and
the split's pass-throughs, hand-off and exit built from it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from accel.parallel.pipeline.split import (
    Exit,
    Handoff,
    Inbox,
    PassThrough,
    StageExit,
    stage_plan,
    stage_view,
)
from accel.parallel.pipeline.trace import trace_forward

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers not installed")


def _opt() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
        max_position_embeddings=16, word_embed_proj_dim=16))


def _bloom() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=64, hidden_size=16, n_layer=2, n_head=2))


@needs_transformers
@pytest.mark.preload("transformers", "transformers.models.opt.modeling_opt")
def test_units_follow_the_forward_not_the_registration() -> None:
    model = _opt()
    registered = [name for name, _ in model.model.decoder.named_children()]
    assert registered.index("final_layer_norm") < registered.index("layers")
    before = torch.get_rng_state()
    trace = trace_forward(model)
    assert torch.equal(torch.get_rng_state(), before)  # no random draw
    assert model.training  # modes restored
    assert trace is not None
    plan = stage_plan(model, ["model.decoder.layers.1"], trace)
    assert plan.units[-3:] == ("model.decoder.layers.1", "model.decoder.final_layer_norm",
                               "lm_head")
    assert plan.stage_of["model.decoder.final_layer_norm"] == 1
    without = stage_plan(model, ["model.decoder.layers.1"])  # registration order
    assert without.stage_of["model.decoder.final_layer_norm"] == 0


@needs_transformers
@pytest.mark.preload("transformers", "transformers.models.bloom.modeling_bloom")
def test_pass_throughs_of_tuple_blocks_return_tuples_and_stages_hand_off() -> None:
    model = _bloom()
    trace = trace_forward(model)
    assert trace is not None
    plan = stage_plan(model, ["transformer.h.1"], trace)
    assert plan.widths.get("transformer.h.0", 0) >= 1
    inbox = Inbox()
    first = stage_view(model, plan, 0, inbox=inbox)
    second = stage_view(model, plan, 1, embeds=True, inbox=inbox)
    assert isinstance(first.transformer.h[1], Exit)
    assert isinstance(second.transformer.h[0], Handoff)
    assert isinstance(second.transformer.word_embeddings, nn.Module)
    ids = torch.randint(0, 64, (2, 5))
    with pytest.raises(StageExit) as done:
        first(input_ids=ids, use_cache=False)
    hidden = done.value.value
    inbox.value = hidden
    logits = second(inputs_embeds=hidden, use_cache=False).logits
    torch.testing.assert_close(logits, model(input_ids=ids, use_cache=False).logits)


def test_a_model_that_is_not_a_token_model_is_not_traced() -> None:
    assert trace_forward(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) is None
    assert PassThrough(width=3)(torch.ones(1))[1:] == (None, None)

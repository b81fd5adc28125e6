"""``tp_plan="auto"`` on transformers MoE models (Mixtral, Qwen2-MoE): their own plans carry
entries for the fused expert weights (``packed_colwise`` on a parameter, ``moe_tp_experts``)
that accel cannot apply yet, and Qwen2-MoE's names dense MLPs this configuration lacks. The
attention is split over 2 tp ranks, the experts stay whole (said once), and training equals
one process. Before, both refused the plan ("names no module")."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                       reason="transformers not installed"),
    pytest.mark.preload("transformers", "transformers.models.mixtral.modeling_mixtral",
                        "transformers.models.qwen2_moe.modeling_qwen2_moe"),
]

VOCAB = 64


def _model(family: str) -> nn.Module:
    import transformers as t

    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    if family == "mixtral":
        config: Any = t.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    else:
        config = t.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16, **common)
    return t.AutoModelForCausalLM.from_config(config)


def _train(family: str) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = accel.prepare_model(_model(family), tp_plan="auto")
    optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(2):
        batch = ids[4 * step:4 * step + 4]
        logits = model(batch).logits
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))
        accel.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    split = sorted(name for name, p in model.named_parameters()
                   if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor")
    return {"losses": losses, "weights": accel.get_state_dict(model), "split": split,
            "said": [str(w.message) for w in caught if "cannot apply yet" in str(w.message)]}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_models_split_their_attention_and_train_as_one_process(family: str) -> None:
    one = run_distributed(_train, family, world_size=1, timeout=120)[0]
    two = run_distributed(_train, family, world_size=2, timeout=120, tp_size=2)
    for out in two:
        assert "model.layers.0.self_attn.q_proj.weight" in out["split"]
        assert not any("experts" in name for name in out["split"])
        assert out["losses"] == pytest.approx(one["losses"], abs=1e-5)
        for name, value in one["weights"].items():
            torch.testing.assert_close(out["weights"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=name)
    assert len(two[0]["said"]) == 1 and "gate_up_proj" in two[0]["said"][0]

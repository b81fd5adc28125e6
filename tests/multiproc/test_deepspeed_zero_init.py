"""``accel.init_partitioned()``: a model built already partitioned under ZeRO-3 (2 gloo
processes), DeepSpeed's ``zero.Init`` with the block's config.

Built inside it, each parameter is a ZeRO-3 partition from the start (half of it per rank),
rank 0's initial values are the ones kept (the other ranks seed differently here), and the
model trains as one plain process (losses and weights within 1e-5); ``get_state_dict`` and
``save_state`` give the full weights, and the checkpoint loads in one plain process. A
transformers GPT-2 from a tiny local config (``from_config``, transformers seeing ZeRO-3)
trains as one process. (That the context does nothing outside ZeRO-3, and refuses what
``accel.prepare`` would, is tests/unit/test_deepspeed_config.py's.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.testing import run_distributed
from tests.deepspeed_marks import DEEPSPEED

pytestmark = DEEPSPEED

ROWS, PER_RANK, LR = 32, 4, 0.01


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g))


def _train(model: Any, optimizer: Any, loader: Any) -> list[float]:
    losses = []
    for x, y in loader:
        with accel.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accel.reduce(loss.detach().float(), "mean")))
    return losses


def _partitioned_run(save_to: str) -> dict[str, Any]:
    """Built inside init_partitioned (rank r seeded with r: rank 0's values must win), then
    trained, gathered and saved."""
    with accel.init_partitioned():
        model = _net(seed=accel.state().rank)
    params = list(model.parameters())
    built = {
        "partitioned": all(hasattr(p, "ds_id") for p in params),
        "full": sum(int(p.ds_numel) for p in params),  # type: ignore[attr-defined]
        "local": sum(p.ds_tensor.numel() for p in params),  # type: ignore[attr-defined]
        "held": sum(p.numel() for p in params),  # the module's own tensors: empty
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(_data(), batch_size=PER_RANK)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    losses = _train(model, optimizer, loader)
    accel.save_state(save_to, model=model, optimizer=optimizer)
    return {**built, "losses": losses, "weights": accel.get_state_dict(model),
            "stage": model.zero_optimization_stage()}


def _plain_run(saved: str) -> dict[str, Any]:
    """One plain process: the same training, then the partitioned run's checkpoint loaded."""
    model = _net(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(_data(), batch_size=2 * PER_RANK)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    losses = _train(model, optimizer, loader)
    weights = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    fresh = _net(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    fresh, fresh_opt = accel.prepare(fresh, fresh_opt)
    accel.load_state(saved, model=fresh, optimizer=fresh_opt)
    return {"losses": losses, "weights": weights, "loaded": accel.get_state_dict(fresh)}


def test_a_model_built_partitioned_trains_saves_and_loads_as_one_process(tmp_path: Path) -> None:
    saved = str(tmp_path / "ckpt")
    zero = run_distributed(_partitioned_run, saved, world_size=2, strategy="deepspeed",
                           zero_stage=3, timeout=120)
    plain = run_distributed(_plain_run, saved, world_size=1, timeout=60)[0]
    for out in zero:
        assert out["partitioned"] and out["stage"] == 3
        assert out["full"] == 5 * 16 + 16 + 16 * 3 + 3
        assert out["local"] < out["full"] and out["held"] == 0
        assert max(abs(a - b) for a, b in zip(out["losses"], plain["losses"], strict=True)) < 1e-5
        assert out["weights"].keys() == plain["weights"].keys()
        for key, value in plain["weights"].items():
            torch.testing.assert_close(out["weights"][key], value, atol=1e-5, rtol=0)
    for key, value in plain["weights"].items():  # save_state's full weights
        torch.testing.assert_close(plain["loaded"][key], value, atol=1e-5, rtol=0)


GPT2_CONFIG = {
    "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def _gpt2_run(initial: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """GPT-2 from its tiny config: under ZeRO-3 built inside init_partitioned (transformers
    initialising the partitions), in one process given the ZeRO-3 run's initial weights."""
    import transformers
    from transformers.integrations import is_deepspeed_zero3_enabled

    from tests.hf import _models as M

    M.quiet_transformers()
    torch.manual_seed(0)
    with accel.init_partitioned():
        seen = is_deepspeed_zero3_enabled()
        model = transformers.AutoModelForCausalLM.from_config(M.config("gpt2"))
    out: dict[str, Any] = {
        "seen": (seen, is_deepspeed_zero3_enabled()),
        "partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
        "tied": model.lm_head.weight is model.transformer.wte.weight,
    }
    if initial is not None:
        model.load_state_dict(initial)
    model.train()
    opt = M.optimizer(model)
    model, opt = accel.prepare(model, opt)
    out["initial"] = M.state(model)
    out["losses"] = M.train(model, opt, "gpt2", range(3), micro=2)
    out["weights"] = M.state(model)
    return out


@pytest.mark.slow  # transformers in the workers
@pytest.mark.ci_extra  # ~6 s
@pytest.mark.preload("transformers", "transformers.models.gpt2.modeling_gpt2")
def test_transformers_gpt2_built_partitioned_trains_as_one_process() -> None:
    pytest.importorskip("transformers")
    zero = run_distributed(_gpt2_run, None, world_size=2, strategy="deepspeed",
                           deepspeed_config=GPT2_CONFIG, gradient_accumulation_steps=2,
                           timeout=120)
    # GPT-2's own init on the gathered partitions (std 0.02), not torch's N(0, 1) embeddings
    assert 0.015 < float(zero[0]["initial"]["transformer.wte.weight"].std()) < 0.025
    plain = run_distributed(_gpt2_run, zero[0]["initial"], world_size=1,
                            gradient_accumulation_steps=2, timeout=120)[0]
    assert plain["seen"] == (False, False) and not plain["partitioned"]
    for out in zero:
        assert out["seen"] == (True, False)  # transformers saw ZeRO-3 inside the context only
        assert out["partitioned"] and out["tied"]
        assert max(abs(a - b) for a, b in zip(out["losses"], plain["losses"], strict=True)) < 1e-5
        assert out["weights"].keys() == plain["weights"].keys()
        worst = max((out["weights"][k] - v).abs().max().item()
                    for k, v in plain["weights"].items())
        assert worst < 1e-5, worst

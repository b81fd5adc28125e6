"""A DeepSpeed config that names its own optimizer, on 2 CPU processes:

- with no torch optimizer passed to ``accel.prepare`` DeepSpeed builds it: it trains as one
  plain process with torch's AdamW and resumes exactly
  (``save_state(model=engine, optimizer=engine.optimizer)``), and DeepSpeed compiles nothing
  (on a CPU its Adam/AdamW become torch's, ``torch_adam``);
- a template config whose optimizer values are all ``"auto"`` (and a WarmupLR section) takes
  them from the loop's torch AdamW under ZeRO-3, as one process with that AdamW and WarmupLR.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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

LR, DECAY, PER_RANK = 0.01, 0.1, 4
CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(32, 5, generator=g), torch.randn(32, 2, generator=g))


def _step(model: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = nn.functional.mse_loss(model(x), y)
    accel.backward(loss)
    model.step()  # DeepSpeed's engine steps the optimizer it built
    return float(accel.reduce(loss.detach(), "mean"))


def _zero2(checkpoint: str) -> dict[str, Any]:
    model, loader = accel.prepare(_net(), DataLoader(_data(), batch_size=PER_RANK))
    losses = []
    batches = list(loader)
    for i, (x, y) in enumerate(batches):
        if i == 2:  # the optimizer DeepSpeed built is saved and loaded as engine.optimizer
            accel.save_state(checkpoint, model=model, optimizer=model.optimizer)
        losses.append(_step(model, x, y))
    weights = accel.get_state_dict(model)
    accel.load_state(checkpoint, model=model, optimizer=model.optimizer)
    again = [_step(model, x, y) for x, y in batches[2:]]
    return {
        "losses": losses, "weights": weights, "again": again,
        "weights_again": accel.get_state_dict(model),
        "optimizer": type(model.optimizer.optimizer).__name__,
        "extensions": os.path.isdir(os.path.expanduser("~/.cache/torch_extensions")),
    }


def _plain(schedule: Callable[[torch.optim.Optimizer], Any] | None = None
           ) -> tuple[nn.Module, list[float]]:
    """One plain process with torch's AdamW (and ``schedule(optimizer)`` stepped after it) on
    the global batches: the model and its losses."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    scheduler = None if schedule is None else schedule(opt)
    losses = []
    for x, y in DataLoader(_data(), batch_size=2 * PER_RANK):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses


@pytest.mark.ci_extra
def test_the_configs_adamw_trains_as_torch_adamw_resumes_and_builds_nothing(
        tmp_path: Path) -> None:
    had_extensions = os.path.isdir(os.path.expanduser("~/.cache/torch_extensions"))
    results = run_distributed(_zero2, str(tmp_path / "ckpt"), world_size=2, strategy="deepspeed",
                              deepspeed_config=CONFIG, timeout=120)
    model, losses = _plain()
    for out in results:
        assert out["optimizer"] == "AdamW"
        assert out["losses"] == pytest.approx(losses, abs=1e-5)
        assert out["again"] == out["losses"][2:]  # resumed exactly
        for name, value in model.state_dict().items():
            torch.testing.assert_close(out["weights"][name], value, atol=1e-5, rtol=0)
            assert torch.equal(out["weights_again"][name], out["weights"][name])
        assert out["extensions"] == had_extensions  # nothing compiled


# the shape of the templates Accelerate and transformers ship: every optimizer value "auto"
TEMPLATE = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                  "warmup_max_lr": "auto",
                                                  "warmup_num_steps": 3}},
    "zero_optimization": {"stage": 3},
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def _template_run() -> dict[str, Any]:
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    model, optimizer, loader = accel.prepare(model, optimizer,
                                             DataLoader(_data(), batch_size=PER_RANK))
    losses = []
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        optimizer.step()  # the engine: the optimizer step, then the config's WarmupLR
        optimizer.zero_grad()
        losses.append(float(accel.reduce(loss.detach(), "mean")))
    return {"losses": losses, "weights": accel.get_state_dict(model),
            "optimizer": type(model.optimizer.optimizer).__name__}


def test_a_template_config_takes_its_autos_from_the_loops_optimizer_under_zero3() -> None:
    from deepspeed.runtime.lr_schedules import WarmupLR

    results = run_distributed(_template_run, world_size=2, strategy="deepspeed",
                              deepspeed_config=TEMPLATE, timeout=120)
    model, losses = _plain(
        lambda opt: WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=LR, warmup_num_steps=3))
    for out in results:
        assert out["optimizer"] == "AdamW"  # the loop's torch AdamW
        assert out["losses"] == pytest.approx(losses, abs=1e-5)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(out["weights"][name], value, atol=1e-5, rtol=0)

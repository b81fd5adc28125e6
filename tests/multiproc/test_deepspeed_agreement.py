"""DeepSpeed ranks that disagree get a named ConfigError on every rank, not a hang or SIGABRT.

ZeRO stages (2 vs 3) and accumulation steps are agreed when the block is entered; what only
DeepSpeed's ``"auto"`` filling decides (the micro batch from each rank's loader) is agreed in
``accel.prepare`` before ``deepspeed.initialize`` runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.errors import ConfigError
from accel.testing import run_distributed
from tests.deepspeed_marks import DEEPSPEED

pytestmark = DEEPSPEED


def _objects(batch: int) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01), DataLoader(data, batch)


def _error_entering(**options: Any) -> str:
    try:
        with accel.distributed(**options):
            accel.prepare(*_objects(4))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _error_preparing(batch: int) -> str:
    try:
        accel.prepare(*_objects(batch))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _body() -> dict[str, str]:
    rank = accel.state().rank
    said = {
        "stage": _error_entering(zero_stage=2 if rank == 0 else 3),
        "accumulation": _error_entering(gradient_accumulation_steps=1 + rank),
        "config": _error_entering(
            deepspeed_config={"zero_optimization": {"stage": 2 if rank == 0 else 3}}
        ),
        "micro batch": _error_preparing(2 if rank == 0 else 4),
    }
    with accel.distributed(zero_stage=2):  # agreed: the engine starts and steps
        model, opt, loader = accel.prepare(*_objects(4))
        for x, y in loader:
            accel.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        said["agreed"] = f"stage {model.zero_optimization_stage()}"
    return said


@pytest.mark.slow  # four engines started and refused, one trained: ~5 s
@pytest.mark.ci_extra
def test_deepspeed_ranks_that_disagree_raise_on_every_rank() -> None:
    out = run_distributed(_body, world_size=2, timeout=90, strategy="deepspeed")
    assert out[0] == out[1]
    said = out[0]
    assert "accel.distributed(): ranks disagree on zero_stage: rank 0 2, rank 1 3" in said["stage"]
    assert "gradient_accumulation_steps: rank 0 1, rank 1 2" in said["accumulation"]
    assert "deepspeed_config.zero_optimization.stage: rank 0 2, rank 1 3" in said["config"]
    assert "accel.prepare() (deepspeed.initialize)" in said["micro batch"]
    assert "train_micro_batch_size_per_gpu: rank 0 2, rank 1 4" in said["micro batch"]
    assert said["agreed"] == "stage 2"

"""DeepSpeed checkpoints in accel's own format cross engines (2 gloo processes).

``save_state`` under ZeRO writes what one plain process writes (fp32 master weights, the
optimizer's state and hyper-parameters by parameter name), so a ZeRO-3 checkpoint resumes in
one plain process and under FSDP2, and a plain checkpoint resumes under ZeRO-2: the next step
(loss and weights) is the same within 1e-5.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.testing import run_distributed

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="needs the deepspeed extra"),
    pytest.mark.preload("deepspeed", "deepspeed.runtime.engine",
                        "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ROWS, GLOBAL, LR = 32, 8, 0.01


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 2, generator=g))


def _step(model: Any, optimizer: Any, scheduler: Any, batch: Any) -> float:
    x, y = batch
    with accel.accumulate(model):
        loss = nn.functional.mse_loss(model(x), y)
        accel.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return float(accel.reduce(loss.detach().float(), "mean"))


def _run(load_from: str | None, save_to: str | None) -> dict[str, Any]:
    """Two steps then ``save_state`` (or ``load_state``), then the next step."""
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(_data(), batch_size=GLOBAL // accel.state().world_size)
    model, optimizer, loader, scheduler = accel.prepare(model, optimizer, loader, scheduler)
    batches = list(loader)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    if load_from is not None:
        info = accel.load_state(load_from, **objects)
        assert info is not None and info.step == 2
    else:
        for batch in batches[:2]:
            _step(model, optimizer, scheduler, batch)
        accel.save_state(save_to, step=2, **objects)
    loss = _step(model, optimizer, scheduler, batches[2])
    return {"loss": loss, "weights": accel.get_state_dict(model)}


def _same_next_step(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert abs(a["loss"] - b["loss"]) < 1e-5
    assert a["weights"].keys() == b["weights"].keys()
    for key, value in a["weights"].items():
        torch.testing.assert_close(b["weights"][key].float(), value.float(), atol=1e-5, rtol=0)


def test_zero3_checkpoint_resumes_in_one_plain_process_and_under_fsdp2(tmp_path: Path) -> None:
    zero = run_distributed(_run, None, str(tmp_path), world_size=2, strategy="deepspeed",
                           zero_stage=3, timeout=120)
    _same_next_step(zero[0], zero[1])
    plain = run_distributed(_run, str(tmp_path), None, world_size=1, timeout=60)
    _same_next_step(zero[0], plain[0])
    fsdp = run_distributed(_run, str(tmp_path), None, world_size=2, strategy="fsdp",
                           timeout=120)
    _same_next_step(zero[0], fsdp[0])


def test_plain_checkpoint_resumes_under_zero2(tmp_path: Path) -> None:
    plain = run_distributed(_run, None, str(tmp_path), world_size=1, timeout=60)
    zero = run_distributed(_run, str(tmp_path), None, world_size=2, strategy="deepspeed",
                           zero_stage=2, timeout=120)
    _same_next_step(plain[0], zero[0])

"""fp8 checkpoints hold the high-precision weights under the plain names, so a plain fp32
model (no torchao) loads them: get_state_dict, save_model, save_state/load_state, and
load_state back into an fp8 run that then trains on exactly as the uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import accel

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        self.out = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


BATCHES = [(torch.randn(16, 32, generator=torch.Generator().manual_seed(i)),
            torch.randn(16, 16, generator=torch.Generator().manual_seed(100 + i)))
           for i in range(4)]


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> None:
    for x, y in batches:
        accel.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _fp8_run() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = accel.prepare_model(Net())
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert isinstance(model.inp, Float8Linear)
    return model, optimizer


def test_state_dicts_and_save_model_load_into_a_plain_fp32_model(tmp_path: Path) -> None:
    with accel.distributed(mixed_precision="fp8"):
        model, optimizer = _fp8_run()
        _steps(model, optimizer, BATCHES[:2])
        full = accel.get_state_dict(model)
        accel.save_model(model, tmp_path / "model")
        x = BATCHES[3][0]
        with accel.distributed(mixed_precision="no"):  # the same weights, unconverted math
            want = nn.functional.linear(x, model.inp.weight, model.inp.bias)
    plain = Net()
    assert list(full) == list(plain.state_dict())  # plain names: weight, bias
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in full.values())
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert saved.keys() == full.keys()
    plain.load_state_dict(saved)  # strict: every key, same shapes
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, full[name])
    assert torch.allclose(plain.inp(x), want)


def test_save_state_then_load_state_into_fp8_and_into_plain_fp32(tmp_path: Path) -> None:
    with accel.distributed(mixed_precision="fp8"):
        model, optimizer = _fp8_run()
        _steps(model, optimizer, BATCHES[:2])
        accel.save_state(tmp_path / "ckpt", model=model, optimizer=optimizer)
        at_save = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
        _steps(model, optimizer, BATCHES[2:])  # the uninterrupted run
        straight = {k: v.clone() for k, v in accel.get_state_dict(model).items()}
    with accel.distributed(mixed_precision="fp8"):  # resumed in a new fp8 run
        again, optimizer = _fp8_run()
        accel.load_state(tmp_path / "ckpt", model=again, optimizer=optimizer)
        _steps(again, optimizer, BATCHES[2:])
        resumed = accel.get_state_dict(again)
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name
    plain = Net()  # no torchao, no accel run options: the weights as saved
    with accel.distributed():
        accel.load_state(tmp_path / "ckpt", model=plain)
    assert all(type(m) is not Float8Linear for m in plain.modules())
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, at_save[name]), name

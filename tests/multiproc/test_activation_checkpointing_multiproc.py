"""Activation checkpointing and regional compilation under DDP and FSDP2 (2 gloo processes).

Each rank prepares the same model three ways on the same batch (plain; checkpointed;
checkpointed and compiled per block) and the gradients, a training step and the saved names
must agree. One spawned run per strategy checks everything for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import accel
from accel.parallel.blockwise import CheckpointedForward
from accel.testing import run_distributed

WIDTH = 8
PER_RANK = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _full(value: torch.Tensor) -> torch.Tensor:
    full = getattr(value, "full_tensor", None)
    return (full() if full is not None else value).detach().clone()


def _step(model: nn.Module, net: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """One forward/backward and AdamW step on this rank's rows; full grads and weights."""
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    x = torch.randn(2 * PER_RANK, 3, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(100 + rank)  # the same dropout masks in every variant
    out = model(x[rank * PER_RANK:(rank + 1) * PER_RANK])
    accel.backward(out.square().mean())
    grads = {f"grad:{n}": _full(p.grad) for n, p in net.named_parameters()}  # type: ignore[arg-type]
    optimizer.step()
    return {**grads, **{n: _full(p) for n, p in net.named_parameters()}}


def _body(strategy: str, directory: str) -> dict[str, Any]:
    st = accel.state()
    result: dict[str, Any] = {}
    plain = _net()
    names = list(plain.state_dict())
    want = _step(accel.prepare_model(plain, strategy=strategy), plain, st.rank)
    variants = {
        "checkpointed": {"activation_checkpointing": True},
        "regional": {  # aot_eager: dynamo + AOTAutograd, no C++ build
            "activation_checkpointing": "Block",
            "compile": {"regional": True, "backend": "aot_eager"},
        },
    }
    for label, options in variants.items():
        net = _net()
        model = accel.prepare_model(net, strategy=strategy, **options)
        result[f"{label}:checkpointed"] = [
            isinstance(block.__dict__.get("forward"), CheckpointedForward) for block in net.blocks
        ]
        result[f"{label}:compiled"] = [
            getattr(block, "_compiled_call_impl", None) is not None for block in net.blocks
        ]
        result[f"{label}:unwrap"] = accel.unwrap_model(model) is net
        got = _step(model, net, st.rank)
        result[f"{label}:max_diff"] = max((got[k] - want[k]).abs().max().item() for k in want)
        result[f"{label}:keys"] = list(accel.get_state_dict(model)) == names
    with accel.distributed(mixed_precision="bf16"):  # bf16: FSDP casts in its hooks
        plain = _net()
        want = _step(accel.prepare_model(plain, strategy=strategy), plain, st.rank)
        net = _net()
        model = accel.prepare_model(net, strategy=strategy, activation_checkpointing=True)
        got = _step(model, net, st.rank)
        result["bf16:max_diff"] = max((got[k] - want[k]).abs().max().item() for k in want)
    if strategy == "fsdp":
        from accel.parallel.fsdp import is_fsdp_module

        result["sharded_blocks"] = [is_fsdp_module(block) for block in net.blocks]
    path = Path(directory)
    accel.save_state(path / "state", model=model)
    accel.save_model(model, path / "weights")
    fresh = Net()  # a plain model, no checkpointing, loads the same names
    accel.load_state(path / "state", model=fresh)
    result["loaded_equal"] = all(
        torch.equal(fresh.state_dict()[name], _full(value))
        for name, value in net.state_dict().items()
    )
    result["names"] = names
    return result


@pytest.mark.slow  # each rank compiles every block with inductor: 6-7 s a strategy
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.ci_extra)])
def test_checkpointing_and_regional_compile_across_two_processes(
    strategy: str, tmp_path: Path
) -> None:
    results = run_distributed(_body, strategy, str(tmp_path), world_size=2, timeout=240)
    for result in results:
        for label in ("checkpointed", "regional"):
            assert result[f"{label}:checkpointed"] == [True, True, True], label
            assert result[f"{label}:unwrap"], label
            assert result[f"{label}:keys"], label
            assert result[f"{label}:max_diff"] < 1e-6, (label, result[f"{label}:max_diff"])
        assert result["bf16:max_diff"] < 1e-6, result["bf16:max_diff"]
        assert result["checkpointed:compiled"] == [False, False, False]
        assert result["regional:compiled"] == [True, True, True]
        assert result["loaded_equal"]
        if strategy == "fsdp":
            assert result["sharded_blocks"] == [True, True, True]
    names = set(results[0]["names"])
    with safe_open(str(tmp_path / "weights" / "model.safetensors"), "pt") as opened:
        assert set(opened.keys()) == names

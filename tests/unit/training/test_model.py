"""prepare_model / unwrap_model / prepare() on one process (fake ranks where DDP is skipped)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch._dynamo  # imported here: it sets TORCHINDUCTOR_CACHE_DIR (conftest env guard)
from torch import nn

import accel
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.errors import AccelError, ConfigError
from accel.precision.casting import AutocastForward
from accel.training.model import is_prepared
from accel.training.optim import PreparedOptimizer
from accel.training.scheduling import PreparedScheduler


@contextmanager
def fake(**fields: Any) -> Iterator[ProcessState]:
    with set_state(ProcessState(**fields), Scope()) as st:
        yield st


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.inner_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x)
        self.inner_dtypes.append(y.dtype)
        return y, x.argmax(dim=-1)


def test_plain_prepare_returns_the_module_on_the_device() -> None:
    net = Net()
    with fake(device=torch.device("meta")):
        prepared = accel.prepare_model(net)
        assert prepared is net
        assert net.linear.weight.device.type == "meta"
        assert "forward" not in net.__dict__  # no wrapper without mixed precision
    other = Net()
    with fake(device=torch.device("meta")):
        accel.prepare_model(other, device_placement=False)
        assert other.linear.weight.device.type == "cpu"


@pytest.mark.parametrize(("policy", "inner"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_forward_returns_fp32(policy: str, inner: torch.dtype) -> None:
    net = Net()
    with fake(mixed_precision=policy):
        prepared = accel.prepare_model(net)
        y, index = prepared(torch.randn(2, 4))
        assert net.inner_dtypes == [inner]  # really computed in reduced precision
        assert y.dtype == torch.float32
        assert index.dtype == torch.int64
        y.sum().backward()
        assert net.linear.weight.grad is not None
        assert net.linear.weight.grad.dtype == torch.float32


def test_prepare_is_idempotent() -> None:
    net = Net()
    with fake(mixed_precision="bf16"):
        prepared = accel.prepare_model(net)
        assert accel.prepare_model(prepared) is prepared
        assert accel.prepare_model(net) is prepared
        assert is_prepared(net)
        forward = net.__dict__["forward"]
        assert isinstance(forward, AutocastForward)
        assert not isinstance(forward.original, AutocastForward)  # wrapped once
    assert not is_prepared(Net())


def test_unwrap_model_restores_forward() -> None:
    net = Net()
    with fake(mixed_precision="bf16"):
        prepared = accel.prepare_model(net)
        assert accel.unwrap_model(prepared) is net
        assert isinstance(net.__dict__["forward"], AutocastForward)  # kept by default
        assert accel.unwrap_model(prepared, keep_fp32_wrapper=False) is net
        assert "forward" not in net.__dict__
        y, _ = net(torch.randn(1, 4))
        assert y.dtype == torch.float32  # the autocast is gone
        assert net.inner_dtypes[-1] == torch.float32


def test_unwrap_keeps_a_user_instance_forward() -> None:
    net = Net()
    calls: list[int] = []

    def custom(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return Net.forward(net, x)

    net.forward = custom  # type: ignore[method-assign]
    with fake(mixed_precision="bf16"):
        accel.prepare_model(net)
        net(torch.randn(1, 4))
        accel.unwrap_model(net, keep_fp32_wrapper=False)
    assert net.__dict__["forward"] is custom
    assert len(calls) == 1


def test_evaluation_mode_and_frozen_models_skip_ddp() -> None:
    # world_size 2 without a process group: reaching DDP would raise.
    with fake(world_size=2, strategy="ddp"):
        net = Net()
        assert accel.prepare_model(net, evaluation_mode=True) is net
        frozen = nn.Linear(2, 2).requires_grad_(False)
        assert accel.prepare_model(frozen) is frozen


def test_strategy_errors() -> None:
    with fake():
        with pytest.raises(ConfigError, match="'zero3'") as info:
            accel.prepare_model(Net(), strategy="zero3")  # type: ignore[arg-type]
        assert isinstance(info.value, AccelError)
        with pytest.raises(ConfigError, match="find_unused_parameter"):
            accel.prepare_model(Net(), find_unused_parameter=True)  # misspelt: unknown key
        accel.prepare_model(Net(), find_unused_parameters=True)  # DDP option: ignored on 1
        with pytest.raises(accel.errors.ArgumentTypeError, match=r"torch\.nn\.Module"):
            accel.prepare_model("not a model")  # type: ignore[arg-type]
    with fake(strategy="fsdp"):  # one process: not sharded (tests/unit/parallel/test_fsdp.py)
        net = Net()
        assert accel.prepare_model(net) is net


def test_compile_wraps_and_unwraps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    # torch.compile sets its cache directory variable on first use: keep it in the test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    net = Net()
    with fake():
        compiled = accel.prepare_model(net, compile=True)
        assert compiled is not net
        assert type(compiled).__name__ == "OptimizedModule"
        assert accel.unwrap_model(compiled) is net
        assert accel.prepare_model(compiled) is compiled
        assert accel.prepare_model(net) is compiled


def test_prepare_dispatches_by_type_in_dependency_order() -> None:
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    other = {"kept": True}
    with fake():
        # scheduler first in the arguments: it still finds its prepared optimizer
        p_sched, p_model, p_opt, p_other = accel.prepare(scheduler, net, optimizer, other)
        assert p_model is net
        assert isinstance(p_opt, PreparedOptimizer)
        assert p_opt.optimizer is optimizer
        assert isinstance(p_sched, PreparedScheduler)
        assert p_sched._optimizer is p_opt
        assert p_other is other
        assert accel.prepare(net) is net  # one object: not a tuple
        assert accel.prepare() == ()
        assert accel.prepare(optimizer) is p_opt


def test_compiled_mixed_precision_forward_has_no_graph_break() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    with fake(mixed_precision="bf16"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = net(x).float()
        # the eager backend: dynamo traces (and would break on a ContextVar read), no inductor
        compiled = accel.prepare_model(net, compile={"backend": "eager"})
        out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()

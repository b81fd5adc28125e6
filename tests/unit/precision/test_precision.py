"""autocast() and the mixed precision policy, on CPU (bf16 and fp16 really run reduced).

The units themselves (registry, GradScaler life): test_precision_units.py; fp8: test_fp8.py.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
import torch._dynamo  # imported here: it sets TORCHINDUCTOR_CACHE_DIR (conftest env guard)

import accel
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.errors import ConfigError
from accel.precision.casting import AutocastForward, outputs_to_fp32
from accel.precision.registry import precision_for

A = torch.ones(4, 4)


def _matmul_dtype() -> torch.dtype:
    return (A @ A).dtype


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("no", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_autocast_follows_policy(policy: str, expected: torch.dtype) -> None:
    with set_state(ProcessState(mixed_precision=policy), Scope()):  # type: ignore[arg-type]
        with accel.autocast():
            assert _matmul_dtype() == expected
        assert _matmul_dtype() == torch.float32  # only inside the block


def test_autocast_overrides() -> None:
    with set_state(ProcessState(mixed_precision="bf16"), Scope()):
        with accel.autocast(dtype=torch.float16):
            assert _matmul_dtype() == torch.float16
        with accel.autocast(enabled=False):
            assert _matmul_dtype() == torch.float32
        with accel.autocast(), accel.autocast(enabled=False):
            assert _matmul_dtype() == torch.float32
    with set_state(ProcessState(mixed_precision="no"), Scope()):
        with accel.autocast(dtype=torch.bfloat16):
            assert _matmul_dtype() == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16), accel.autocast(enabled=False):
            assert _matmul_dtype() == torch.float32


def test_autocast_dtype_policy() -> None:
    assert precision_for("no").forward_dtype() is None
    assert precision_for("bf16").forward_dtype() is torch.bfloat16
    assert precision_for("fp16").forward_dtype() is torch.float16
    assert precision_for("fp8").forward_dtype() is torch.bfloat16
    with pytest.raises(ConfigError, match="'fp4'"):
        precision_for("fp4")


Pair = namedtuple("Pair", ["a", "b"])


def test_outputs_to_fp32_walks_structures() -> None:
    half = torch.ones(2, dtype=torch.float16)
    bf = torch.ones(2, dtype=torch.bfloat16)
    ints = torch.ones(2, dtype=torch.int64)
    double = torch.ones(2, dtype=torch.float64)
    out = outputs_to_fp32({"x": [half, (bf, ints)], "p": Pair(double, "s"), "n": 3})
    assert out["x"][0].dtype == torch.float32
    assert out["x"][1][0].dtype == torch.float32
    assert out["x"][1][1] is ints
    assert isinstance(out["p"], Pair)
    assert out["p"].a is double
    assert out["p"].b == "s"
    assert out["n"] == 3


class _Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.linear(x)
        self.seen.append(y.dtype)
        return {"y": y}


def test_autocast_forward_reads_policy_at_call_time() -> None:
    module = _Recorder()
    wrapped = AutocastForward(module.forward)
    with set_state(ProcessState(mixed_precision="bf16"), Scope()):
        out = wrapped(torch.ones(1, 4))
        assert out["y"].dtype == torch.float32
        assert module.seen[-1] == torch.bfloat16
        with accel.distributed(mixed_precision="no"):  # nested scope: full precision block
            wrapped(torch.ones(1, 4))
            assert module.seen[-1] == torch.float32
        wrapped(torch.ones(1, 4))
        assert module.seen[-1] == torch.bfloat16


def _autocast_switches() -> tuple[bool, torch.dtype, bool]:
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled())


def test_autocast_forward_restores_the_switches_it_sets() -> None:
    module = _Recorder()
    wrapped = AutocastForward(module.forward)
    before = _autocast_switches()
    with set_state(ProcessState(mixed_precision="bf16"), Scope()):
        wrapped(torch.ones(1, 4))
        assert _autocast_switches() == before
        with torch.autocast("cpu", dtype=torch.float16):  # a user's region around it
            inside = _autocast_switches()
            wrapped(torch.ones(1, 4))
            assert module.seen[-1] == torch.bfloat16  # the policy's dtype inside the forward
            assert _autocast_switches() == inside
            assert (A @ A).dtype == torch.float16
        assert _autocast_switches() == before


def test_autocast_forward_restores_the_switches_when_the_forward_raises() -> None:
    def failing(x: torch.Tensor) -> torch.Tensor:
        assert torch.is_autocast_enabled("cpu")
        raise ValueError("boom")

    before = _autocast_switches()
    with set_state(ProcessState(mixed_precision="fp16"), Scope()), pytest.raises(
        ValueError, match="boom"
    ):
        AutocastForward(failing)(torch.ones(1))
    assert _autocast_switches() == before
    assert (A @ A).dtype == torch.float32


def test_autocast_forward_follows_a_policy_change_between_calls() -> None:
    module = _Recorder()
    wrapped = AutocastForward(module.forward)
    for policy, expected in [("bf16", torch.bfloat16), ("fp16", torch.float16),
                             ("no", torch.float32), ("bf16", torch.bfloat16)]:
        with set_state(ProcessState(mixed_precision=policy), Scope()):  # type: ignore[arg-type]
            assert wrapped(torch.ones(1, 4))["y"].dtype == torch.float32
            assert module.seen[-1] == expected


def test_autocast_forward_under_a_torch_function_mode_uses_torch_autocast() -> None:
    from torch.overrides import TorchFunctionMode

    seen: list[object] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    module = _Recorder()
    with set_state(ProcessState(mixed_precision="bf16"), Scope()), Watch():
        out = AutocastForward(module.forward)(torch.ones(1, 4))
    assert module.seen[-1] == torch.bfloat16
    assert out["y"].dtype == torch.float32
    assert seen  # the mode saw the forward's calls


def test_fp32_outputs_come_back_as_the_same_objects() -> None:
    full = torch.ones(2)
    ints = torch.arange(3)
    nested = {"a": [full, (ints, "x")], "p": Pair(full, 1)}
    assert outputs_to_fp32(nested) is nested
    assert outputs_to_fp32(full) is full
    listed = [full, ints]
    assert outputs_to_fp32(listed) is listed
    with set_state(ProcessState(mixed_precision="bf16"), Scope()):
        wrapped = AutocastForward(lambda: nested)
        assert wrapped() is nested

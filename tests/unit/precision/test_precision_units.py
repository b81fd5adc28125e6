"""The precision units: one per mode, chosen by the registry, owning autocast, the prepared
forward, FSDP's policy and master weights, the GradScaler's life (fp8's own layers:
test_fp8.py)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs
import pytest
import torch
from torch import nn

import accel
from accel.core.scope import Scope, scope
from accel.core.settings import MIXED_PRECISION_MODES
from accel.core.state import ProcessState, set_state
from accel.errors import ConfigError
from accel.precision import registry
from accel.precision.base import Precision
from accel.precision.casting import AutocastForward
from accel.precision.half import BFloat16, Float16, HalfPrecision
from accel.precision.registry import PRECISIONS, precision_for
from accel.precision.scaling import load_scaler_state_dict, scaler_state_dict

A = torch.ones(4, 4)


@contextmanager
def fake(mode: str) -> Iterator[ProcessState]:
    with set_state(ProcessState(mixed_precision=mode), Scope()) as st:  # type: ignore[arg-type]
        yield st


# -- the registry -------------------------------------------------------------------------
def test_every_mode_has_its_unit() -> None:
    assert tuple(PRECISIONS) == MIXED_PRECISION_MODES
    for mode, unit in PRECISIONS.items():
        assert precision_for(mode) is unit  # one instance per mode, no allocation per ask
        assert unit.mode == mode
        assert attrs.has(type(unit))
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            unit.mode = "x"  # type: ignore[misc]
    assert type(precision_for("no")) is Precision
    assert type(precision_for("fp8")).__mro__[1] is BFloat16  # bf16 around its float8 layers


def test_an_unknown_mode_names_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        precision_for("fp4")
    message = str(info.value)
    assert "'fp4'" in message and "['no', 'fp16', 'bf16', 'fp8']" in message
    assert "mixed_precision='bf16'" in message


@attrs.frozen
class _Float16Unscaled(HalfPrecision):
    """A mode made for the test: fp16 autocast, no loss scaling."""

    mode: ClassVar[str] = "fp16-unscaled"
    dtype: ClassVar[torch.dtype | None] = torch.float16


def test_a_new_mode_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.PRECISIONS, "fp16-unscaled", _Float16Unscaled())  # type: ignore[index]
    with fake("fp16-unscaled"):
        with accel.autocast():
            assert (A @ A).dtype == torch.float16
        net = nn.Sequential(nn.Linear(4, 4))
        seen: list[torch.dtype] = []
        net[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        model = accel.prepare_model(net)
        assert isinstance(net.__dict__["forward"], AutocastForward)
        assert model(torch.ones(1, 4)).dtype == torch.float32 and seen == [torch.float16]
        optimizer = accel.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        assert optimizer.scaler is None and scope().grad_scaler is None
        accel.backward(model(torch.ones(1, 4)).sum())
        optimizer.step()


# -- autocast, the prepared forward, FSDP -------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "dtype"),
    [("no", None), ("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp8", torch.bfloat16)],
)
def test_each_unit_casts_in_its_dtype(mode: str, dtype: torch.dtype | None) -> None:
    unit = precision_for(mode)
    assert unit.dtype is dtype
    assert unit.forward_dtype() is dtype
    assert unit.forward_casting("cpu") == (dtype, dtype is not None)
    with unit.autocast("cpu"):
        assert (A @ A).dtype == (dtype or torch.float32)
    with unit.autocast("cpu", dtype=torch.float16):
        assert (A @ A).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16), unit.autocast("cpu", enabled=False):
        assert (A @ A).dtype == torch.float32
    policy = unit.fsdp_policy()
    if dtype is None:
        assert policy is None
    else:
        assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
            dtype, dtype, None
        )


def test_master_weights_are_upcast_only_under_mixed_precision() -> None:
    def model() -> nn.Sequential:
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).to(torch.bfloat16)
        net[1].weight.requires_grad_(False)
        return net

    kept = model()
    with fake("no"):
        precision_for("no").upcast_master_weights(kept)
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}
    for mode in ("bf16", "fp16", "fp8"):
        net = model()
        with fake(mode):
            precision_for(mode).upcast_master_weights(net)
        assert net[0].weight.dtype == net[0].bias.dtype == net[1].bias.dtype == torch.float32
        assert net[1].weight.dtype == torch.bfloat16  # frozen: not a master weight


def test_no_wrapper_under_full_precision() -> None:
    with fake("no"):
        net = nn.Linear(2, 2)
        accel.prepare_model(net)
        assert "forward" not in net.__dict__
    with fake("bf16"):
        accel.prepare_model(net)  # prepared already: the same object, still unwrapped
        assert "forward" not in net.__dict__
        other = nn.Linear(2, 2)
        accel.prepare_model(other)
        assert isinstance(other.__dict__["forward"], AutocastForward)
        accel.unwrap_model(other, keep_fp32_wrapper=False)
        assert "forward" not in other.__dict__


# -- the GradScaler's life ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["no", "bf16", "fp8"])
def test_only_fp16_makes_a_scaler(mode: str) -> None:
    unit = precision_for(mode)
    with fake(mode):
        loss = torch.ones((), requires_grad=True)
        assert unit.optimizer_scaler() is None and scope().grad_scaler is None
        scope().grad_scaler = torch.amp.GradScaler("cpu")  # e.g. an outer fp16 block's
        assert unit.active_scaler() is None
        assert unit.scale_loss(loss) is loss
        assert unit.unscaled_norm(norm := torch.tensor(3.0)) is norm


def test_fp16_makes_one_scaler_per_scope_and_scales_with_it() -> None:
    unit = precision_for("fp16")
    assert isinstance(unit, Float16)
    with fake("fp16"):
        loss = torch.full((), 2.0, requires_grad=True)
        assert unit.active_scaler() is None
        assert unit.scale_loss(loss) is loss  # no optimizer prepared yet: nothing to scale
        scaler = unit.optimizer_scaler()
        assert isinstance(scaler, torch.amp.GradScaler)
        assert unit.optimizer_scaler() is scaler is scope().grad_scaler is unit.active_scaler()
        assert scaler.get_scale() == 65536.0
        assert unit.scale_loss(loss).item() == 2.0 * 65536
        assert unit.unscaled_norm(torch.tensor(65536.0)).item() == 1.0
        with accel.distributed(mixed_precision="no"):  # a nested fp32 block: no scaling
            assert precision_for(accel.state().mixed_precision).active_scaler() is None
            assert scope().grad_scaler is scaler  # the scope's, kept for the outer block
    with fake("fp16"):
        assert unit.optimizer_scaler() is not scaler  # a new scope, a new scaler


def test_fp16_unscales_once_per_step_and_tells_a_skipped_step() -> None:
    unit = precision_for("fp16")
    with fake("fp16"):
        net = nn.Linear(2, 1)
        optimizer = accel.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=1.0))
        accel.backward(net(torch.ones(1, 2)).sum())
        assert net.weight.grad is not None
        assert torch.equal(net.weight.grad, torch.full_like(net.weight, 65536.0))
        unit.unscale(optimizer.optimizer, optimizer, None)
        unit.unscale(optimizer.optimizer, optimizer, None)  # once: the second does nothing
        assert optimizer.grads_unscaled
        assert torch.equal(net.weight.grad, torch.ones_like(net.weight))
        optimizer.step()
        assert not optimizer.grads_unscaled and not optimizer.step_was_skipped
        accel.backward(net(torch.ones(1, 2)).sum())
        net.weight.grad[0, 0] = float("inf")
        optimizer.step()
        assert optimizer.step_was_skipped and accel.optimizer_step_was_skipped(optimizer)
        assert scaler_state_dict() == optimizer.scaler.state_dict()
        assert optimizer.scaler.get_scale() == 32768.0


def test_the_scaler_state_goes_with_the_scope() -> None:
    with fake("bf16"):
        assert scaler_state_dict() is None
        load_scaler_state_dict({})  # saved without fp16: nothing made
        assert scope().grad_scaler is None
        saved = torch.amp.GradScaler("cpu", init_scale=8.0).state_dict()
        load_scaler_state_dict(saved)  # made on the state's device to hold it
        assert scope().grad_scaler.get_scale() == 8.0
        assert scaler_state_dict() == saved


# -- fp8 says nothing about bf16 any more --------------------------------------------------
def test_fp8_autocast_is_bf16_and_says_nothing() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accel.distributed(mixed_precision="fp8") as st, accel.autocast():
            assert st.mixed_precision == "fp8"
            assert (A @ A).dtype == torch.bfloat16
    assert not [w for w in caught if "runs as bf16" in str(w.message)]


def _units_are_stateless(unit: Any) -> bool:
    return attrs.fields(type(unit)) == ()


def test_units_hold_no_state() -> None:
    assert all(_units_are_stateless(unit) for unit in PRECISIONS.values())

"""backward / accumulate / sync flags / no_sync on one process (fake policies)."""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch._dynamo  # imported here: it sets TORCHINDUCTOR_CACHE_DIR (conftest env guard)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import accel
from accel.core.scope import Scope, scope
from accel.core.state import ProcessState, set_state
from accel.training.accumulation import accumulation_step


@contextmanager
def fake(**fields: Any) -> Iterator[ProcessState]:
    with set_state(ProcessState(**fields), Scope()) as state:
        yield state


class _Loader:
    """Stands in for a prepared loader being iterated (what accumulate reads)."""

    def __init__(self) -> None:
        self.end_of_dataloader = False
        self.remainder = -1


def test_backward_divides_by_accumulation_steps() -> None:
    weight = torch.ones(3, requires_grad=True)
    with fake(gradient_accumulation_steps=4):
        accel.backward((weight * 2.0).sum())
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, torch.full((3,), 0.5))
    with fake():
        weight.grad = None
        accel.backward((weight * 2.0).sum(), retain_graph=False)
    torch.testing.assert_close(weight.grad, torch.full((3,), 2.0))


def test_backward_scales_under_fp16_with_a_prepared_optimizer() -> None:
    weight = torch.ones(3, requires_grad=True)
    with fake(mixed_precision="fp16", gradient_accumulation_steps=2):
        accel.backward(weight.sum())  # no optimizer prepared yet: no scaler, no scaling
        torch.testing.assert_close(weight.grad, torch.full((3,), 0.5))
        accel.prepare_optimizer(torch.optim.SGD([weight], lr=0.1))
        weight.grad = None
        accel.backward(weight.sum())
        torch.testing.assert_close(weight.grad, torch.full((3,), 0.5 * 65536))


def _sync_pattern(steps: int, batches: int, model: nn.Module | None) -> list[bool]:
    flags = []
    with fake(gradient_accumulation_steps=steps):
        loader = _Loader()
        scope().active_loaders.append(loader)
        for index in range(batches):
            loader.end_of_dataloader = index == batches - 1
            models = () if model is None else (model,)
            with accel.accumulate(*models) as sync:
                assert accel.sync_gradients() is sync
                flags.append(sync)
            assert accel.sync_gradients() is sync  # kept after the block
    return flags


@settings(max_examples=40, deadline=None)
@given(steps=st.integers(1, 5), batches=st.integers(1, 12), with_model=st.booleans())
def test_accumulate_syncs_every_k_and_on_the_last_batch(
    steps: int, batches: int, with_model: bool
) -> None:
    flags = _sync_pattern(steps, batches, nn.Linear(1, 1) if with_model else None)
    expected = [(i + 1) % steps == 0 or i == batches - 1 for i in range(batches)]
    assert flags == expected


def test_a_models_counter_goes_with_the_model() -> None:
    model = nn.Linear(1, 1)
    with fake(gradient_accumulation_steps=3):
        with accel.accumulate(model):
            pass
        assert len(scope().model_steps) == 1
        del model
        gc.collect()
        assert len(scope().model_steps) == 0  # weakly keyed: no model kept alive


def test_counter_is_kept_per_model_in_the_scope_and_restarts_each_epoch() -> None:
    first, second = nn.Linear(1, 1), nn.Linear(1, 1)
    with fake(gradient_accumulation_steps=3):
        loader = _Loader()
        scope().active_loaders.append(loader)
        with accel.accumulate(first):
            pass
        with accel.accumulate(first) as sync:
            assert not sync
        with accel.accumulate(second) as sync:  # its own count
            assert not sync
        assert accumulation_step(first) == 2
        assert accumulation_step(second) == 1
        assert set(first.__dict__) == set(nn.Linear(1, 1).__dict__)  # nothing on the model
        loader.end_of_dataloader = True
        with accel.accumulate(first) as sync:
            assert sync
        loader.end_of_dataloader = False
        flags = []
        for _ in range(3):  # next epoch starts a fresh count
            with accel.accumulate(first) as sync:
                flags.append(sync)
        assert flags == [False, False, True]
    with fake():
        assert accel.sync_gradients()  # a new scope starts synchronised
        with accel.accumulate(first) as sync:
            assert sync


def test_innermost_loader_decides_the_last_batch() -> None:
    model = nn.Linear(1, 1)
    with fake(gradient_accumulation_steps=4):
        outer, inner = _Loader(), _Loader()
        outer.end_of_dataloader = True
        scope().active_loaders.extend([outer, inner])
        with accel.accumulate(model) as sync:
            assert not sync
        scope().active_loaders.pop()
        with accel.accumulate(model) as sync:
            assert sync


def test_accumulated_training_equals_one_big_batch() -> None:
    torch.manual_seed(0)
    base = nn.Linear(4, 2)
    data = torch.randn(6, 4)
    target = torch.randn(6, 2)

    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(data), target).backward()
    ref_opt.step()

    model = copy.deepcopy(base)
    with fake(gradient_accumulation_steps=3):
        model, optimizer = accel.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for chunk in range(3):
            x, y = data[2 * chunk : 2 * chunk + 2], target[2 * chunk : 2 * chunk + 2]
            with accel.accumulate(model) as sync:
                accel.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            assert sync == (chunk == 2)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_no_sync_and_trigger_are_no_ops_on_plain_modules() -> None:
    model = nn.Linear(1, 1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.ones(2, 1)
    with fake():
        with accel.no_sync(model) as inside:
            model(x).sum().backward()
        assert inside is None
        assert model.weight.grad is not None
        first = model.weight.grad.clone()
        with accel.trigger_sync_in_backward(model) as armed:
            model(x).sum().backward()
        assert armed is None
    # gradients accumulate locally as without the contexts; the module itself is unchanged
    torch.testing.assert_close(model.weight.grad, 2 * first)
    assert type(model) is nn.Linear and not hasattr(model, "require_backward_grad_sync")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name])


class _Fsdp2Like(nn.Module):
    """Has FSDP2's gradient-sync switch (the method accel looks for on the type)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.calls.append(requires)


def test_fsdp2_style_modules_toggle_gradient_sync() -> None:
    model = _Fsdp2Like()
    with fake(gradient_accumulation_steps=2):
        with accel.accumulate(model) as sync:
            assert not sync
            assert model.calls == [False]
        assert model.calls == [False, True]
        with accel.accumulate(model) as sync:  # sync step: untouched
            assert sync
        assert model.calls == [False, True]
        with accel.no_sync(model):
            pass
        with accel.trigger_sync_in_backward(model):
            pass
        assert model.calls == [False, True, False, True, True]


def test_accumulate_exits_the_model_contexts_on_error() -> None:
    model = _Fsdp2Like()
    with fake(gradient_accumulation_steps=2):
        with pytest.raises(RuntimeError, match="boom"), accel.accumulate(model):
            raise RuntimeError("boom")
        assert model.calls == [False, True]

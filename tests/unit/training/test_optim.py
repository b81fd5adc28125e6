"""Prepared optimizers and schedulers, the fp16 GradScaler and clipping, on one process."""

from __future__ import annotations

import pickle
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
from accel.precision.scaling import load_scaler_state_dict, scaler_state_dict
from accel.training.optim import PreparedOptimizer
from accel.training.scheduling import PreparedScheduler


@contextmanager
def fake(**fields: Any) -> Iterator[ProcessState]:
    with set_state(ProcessState(**fields), Scope()) as state:
        yield state


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _grads(model: nn.Module, value: float = 1.0) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def test_step_and_zero_grad_only_on_sync_steps() -> None:
    model = _model()
    with fake():
        optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        assert isinstance(optimizer, torch.optim.Optimizer)
        before = model.weight.detach().clone()
        _grads(model)
        scope().sync_gradients = False
        optimizer.step()
        optimizer.zero_grad()
        assert torch.equal(model.weight, before)
        assert model.weight.grad is not None
        scope().sync_gradients = True
        optimizer.step()
        assert torch.equal(model.weight, before - 1.0)
        optimizer.zero_grad()
        assert model.weight.grad is None
        _grads(model)
        optimizer.zero_grad(set_to_none=False)
        assert model.weight.grad is not None
        assert torch.count_nonzero(model.weight.grad) == 0
        assert not accel.optimizer_step_was_skipped(optimizer)


def test_optimizer_passthrough_and_identity() -> None:
    model = _model()
    raw = torch.optim.Adam(model.parameters(), lr=0.01)
    with fake():
        optimizer = accel.prepare_optimizer(raw)
        assert accel.prepare_optimizer(raw) is optimizer
        assert accel.prepare_optimizer(optimizer) is optimizer
        assert optimizer.param_groups is raw.param_groups
        assert optimizer.defaults is raw.defaults
        _grads(model)
        optimizer.step()
        assert optimizer.state is raw.state
        saved = optimizer.state_dict()
        assert saved["state"][0]["step"] == 1
        fresh = torch.optim.Adam(model.parameters(), lr=0.01)
        accel.prepare_optimizer(fresh).load_state_dict(saved)
        assert fresh.state_dict()["state"][0]["step"] == 1
        optimizer.param_groups[0]["lr"] = 0.5
        assert raw.param_groups[0]["lr"] == 0.5
        assert optimizer.zero_grad.__self__ is optimizer  # own method, not the raw one
        assert "Adam" in repr(optimizer)
        with pytest.raises(accel.errors.NotPicklableError, match="state_dict"):
            pickle.dumps(optimizer)
        with pytest.raises(accel.errors.ArgumentTypeError, match="Optimizer"):
            accel.prepare_optimizer(object())


def _fp16_setup() -> tuple[nn.Linear, PreparedOptimizer, PreparedScheduler]:
    model = _model()
    raw = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(raw, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accel.prepare(model, raw, scheduler)
    return model, optimizer, scheduler


def _fp16_backward(model: nn.Module, poison: bool = False) -> None:
    loss = model(torch.ones(1, 3)).sum() * 1e-3
    accel.backward(loss)
    if poison:
        model.weight.grad[0, 0] = float("inf")  # type: ignore[index]


def test_fp16_overflow_skips_optimizer_and_scheduler_step() -> None:
    with fake(mixed_precision="fp16"):
        model, optimizer, scheduler = _fp16_setup()
        scaler = scope().grad_scaler
        assert isinstance(scaler, torch.amp.GradScaler)
        assert optimizer.scaler is scaler
        before = model.weight.detach().clone()
        scale = scaler.get_scale()

        _fp16_backward(model, poison=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        assert accel.optimizer_step_was_skipped(optimizer)
        assert accel.optimizer_step_was_skipped(optimizer.optimizer)  # the raw one too
        assert torch.equal(model.weight, before)
        assert scheduler.get_last_lr() == [1.0]
        assert scaler.get_scale() == scale / 2

        _fp16_backward(model)
        optimizer.step()
        scheduler.step()
        assert not accel.optimizer_step_was_skipped(optimizer)
        assert not torch.equal(model.weight, before)
        assert scheduler.get_last_lr() == [0.5]


def _backward_with_grad(model: nn.Module, value: float) -> None:
    """accel.backward of a loss whose gradient is ``value`` for every parameter entry."""
    accel.backward(value * sum(p.sum() for p in model.parameters()))


def test_fp16_gradients_are_unscaled_before_the_step() -> None:
    with fake(mixed_precision="fp16"):
        model, optimizer, _ = _fp16_setup()
        before = model.weight.detach().clone()
        _backward_with_grad(model, 0.25)
        assert model.weight.grad is not None
        torch.testing.assert_close(model.weight.grad, torch.full_like(before, 0.25 * 65536))
        optimizer.step()
        assert not accel.optimizer_step_was_skipped(optimizer)
    torch.testing.assert_close(model.weight, before - 0.25)


def test_scaler_state_saved_and_restored() -> None:
    with fake(mixed_precision="fp16"):
        model, optimizer, _ = _fp16_setup()
        for _ in range(2):
            _fp16_backward(model, poison=True)
            optimizer.step()
        saved = scaler_state_dict()
        assert saved is not None
        assert saved["scale"] == 65536.0 / 4
    with fake(mixed_precision="fp16"):
        load_scaler_state_dict(saved)  # before any optimizer: creates the scaler
        model, optimizer, _ = _fp16_setup()
        assert optimizer.scaler is scope().grad_scaler
        assert optimizer.scaler is not None
        assert optimizer.scaler.get_scale() == 65536.0 / 4
        assert scaler_state_dict() == saved
    with fake():
        assert scaler_state_dict() is None
        load_scaler_state_dict(None)
        assert scope().grad_scaler is None


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_scheduler_steps_world_size_times_unless_split(world_size: int) -> None:
    model = _model()
    raw = torch.optim.SGD(model.parameters(), lr=1.0)
    with fake(world_size=world_size):
        optimizer = accel.prepare_optimizer(raw)
        scheduler = accel.prepare_scheduler(torch.optim.lr_scheduler.LambdaLR(raw, lambda s: s))
        split = accel.prepare_scheduler(
            torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1.0),
                                              lambda s: s),
            split_batches=True,
        )
        plain = accel.prepare_scheduler(
            torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1.0),
                                              lambda s: s),
            step_with_optimizer=False,
        )
        for _ in range(2):
            _grads(model)
            optimizer.step()
            scheduler.step()
            split.step()
            plain.step()
        assert scheduler.last_epoch == 2 * world_size
        assert scheduler.get_last_lr() == [2.0 * world_size]
        assert split.last_epoch == 2
        assert plain.last_epoch == 2
        scope().sync_gradients = False  # accumulating: only the plain one moves
        scheduler.step()
        split.step()
        plain.step()
        assert (scheduler.last_epoch, split.last_epoch, plain.last_epoch) == (
            2 * world_size, 2, 3
        )


class _Loader:
    def __init__(self, split_batches: bool) -> None:
        self.split_batches = split_batches
        self.end_of_dataloader = False


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_scheduler_reads_split_batches_from_the_active_loader() -> None:
    model = _model()
    raw = torch.optim.SGD(model.parameters(), lr=1.0)
    with fake(world_size=4):
        scheduler = accel.prepare_scheduler(torch.optim.lr_scheduler.StepLR(raw, 1))
        scope().active_loaders.append(_Loader(split_batches=True))
        scheduler.step()
        assert scheduler.last_epoch == 1
        scope().active_loaders[-1] = _Loader(split_batches=False)
        scheduler.step()
        assert scheduler.last_epoch == 5


def test_one_cycle_does_not_step_past_total_steps() -> None:
    model = _model()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    with fake(world_size=3):
        optimizer = accel.prepare_optimizer(raw)
        scheduler = accel.prepare_scheduler(
            torch.optim.lr_scheduler.OneCycleLR(raw, max_lr=0.1, total_steps=7)
        )
        for _ in range(4):  # 12 scheduler steps wanted, 7 allowed
            _grads(model)
            optimizer.step()
            scheduler.step()
        assert scheduler.last_epoch == 7
        assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)


def test_reduce_on_plateau_steps_once() -> None:
    model = _model()
    raw = torch.optim.SGD(model.parameters(), lr=1.0)
    with fake(world_size=4):
        scheduler = accel.prepare_scheduler(
            torch.optim.lr_scheduler.ReduceLROnPlateau(raw, patience=2)
        )
        for _ in range(3):
            scheduler.step(1.0)
        assert scheduler.num_bad_epochs == 2
        assert scheduler.get_last_lr() == [1.0]


def test_scheduler_on_prepared_optimizer_and_state_dict() -> None:
    model = _model()
    with fake(mixed_precision="fp16"):
        optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        # built on the prepared optimizer, prepared before any step
        scheduler = accel.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.1))
        assert scheduler._optimizer is optimizer
        _fp16_backward(model, poison=True)
        optimizer.step()
        scheduler.step()
        assert scheduler.last_epoch == 0  # skipped with the optimizer
        optimizer.zero_grad()
        _fp16_backward(model)
        optimizer.step()
        scheduler.step()
        assert scheduler.last_epoch == 1
        saved = scheduler.state_dict()
        assert saved["last_epoch"] == 1
        other = accel.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.1))
        other.load_state_dict(saved)
        assert other.last_epoch == 1
        assert other.get_last_lr() == scheduler.get_last_lr()
        assert accel.prepare_scheduler(scheduler) is scheduler
        with pytest.raises(accel.errors.ArgumentTypeError, match="LRScheduler"):
            accel.prepare_scheduler(object())


def test_clip_grad_norm_matches_torch() -> None:
    model = _model()
    reference = _model()
    with fake():
        accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        _grads(model, 3.0)
        _grads(reference, 3.0)
        norm = accel.clip_grad_norm_(model.parameters(), 1.0)
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        torch.testing.assert_close(norm, expected)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
        accel.clip_grad_value_(model.weight, 0.1)
        assert model.weight.grad is not None
        assert model.weight.grad.abs().max() <= 0.1


def test_fp16_clip_unscales_once_per_step() -> None:
    with fake(mixed_precision="fp16"):
        model, optimizer, _ = _fp16_setup()
        scaler = optimizer.scaler
        assert scaler is not None
        for _ in range(2):  # twice: the unscaled mark resets after each step
            _backward_with_grad(model, 2.0)
            norm = accel.clip_grad_norm_(model.parameters(), 100.0)
            torch.testing.assert_close(norm, torch.tensor(2.0 * 8**0.5))
            # a second clip, an explicit unscale: no "unscale_() has already been called"
            accel.clip_grad_norm_(model.parameters(), 100.0)
            accel.clip_grad_value_(model.parameters(), 100.0)
            accel.unscale_gradients()
            accel.unscale_gradients(optimizer)
            accel.unscale_gradients([optimizer.optimizer])
            assert model.weight.grad is not None
            torch.testing.assert_close(model.weight.grad, torch.full_like(model.weight, 2.0))
            optimizer.step()
            optimizer.zero_grad()
            assert not accel.optimizer_step_was_skipped(optimizer)


def test_clipping_leaves_partial_gradients_alone_on_non_sync_steps() -> None:
    with fake(mixed_precision="fp16"):
        model, optimizer, _ = _fp16_setup()
        scaler = optimizer.scaler
        assert scaler is not None
        scope().sync_gradients = False
        _backward_with_grad(model, 2.0)
        norm = accel.clip_grad_norm_(model.parameters(), 0.1)
        torch.testing.assert_close(norm, torch.tensor(2.0 * 8**0.5))  # unscaled units
        accel.clip_grad_value_(model.parameters(), 0.1)
        accel.unscale_gradients()
        assert model.weight.grad is not None
        assert model.weight.grad.abs().min() == 2.0 * scaler.get_scale()  # untouched, scaled
        scope().sync_gradients = True
        accel.clip_grad_norm_(model.parameters(), 0.1)  # now unscales (first time) and clips
        optimizer.step()
        assert not accel.optimizer_step_was_skipped(optimizer)


def test_unprepared_optimizer_reports_no_skip() -> None:
    with fake():
        assert not accel.optimizer_step_was_skipped(torch.optim.SGD(_model().parameters()))
        accel.unscale_gradients()  # no scaler: nothing to do


@settings(max_examples=30, deadline=None)
@given(
    world_size=st.integers(1, 5),
    split=st.booleans(),
    steps=st.integers(1, 6),
    total=st.integers(1, 20),
)
def test_scheduler_step_count_property(
    world_size: int, split: bool, steps: int, total: int
) -> None:
    model = _model()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    with fake(world_size=world_size):
        optimizer = accel.prepare_optimizer(raw)
        scheduler = accel.prepare_scheduler(
            torch.optim.lr_scheduler.OneCycleLR(raw, max_lr=0.1, total_steps=total),
            split_batches=split,
        )
        for _ in range(steps):
            _grads(model)
            optimizer.step()
            scheduler.step()
        per_step = 1 if split else world_size
        assert scheduler.last_epoch == min(total, steps * per_step)


def test_nested_full_precision_block_trains_without_loss_scaling() -> None:
    with fake(mixed_precision="fp16"):
        model, optimizer, _ = _fp16_setup()
        before = model.weight.detach().clone()
        with accel.distributed(mixed_precision="no"):
            _backward_with_grad(model, 0.5)
            assert model.weight.grad is not None
            torch.testing.assert_close(model.weight.grad, torch.full_like(before, 0.5))
            accel.clip_grad_norm_(model.parameters(), 100.0)  # nothing to unscale
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(model.weight, before - 0.5)
        _backward_with_grad(model, 0.5)  # back under fp16: scaled again
        torch.testing.assert_close(model.weight.grad, torch.full_like(before, 0.5 * 65536))


class _DuckOptimizer:
    """Not a torch Optimizer (no step hooks): skipped steps are told by the scale."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]
        self.state: dict[Any, Any] = {}
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None


def test_fp16_skip_detection_without_step_hooks() -> None:
    weight = torch.ones(3, requires_grad=True)
    with fake(mixed_precision="fp16"):
        duck = _DuckOptimizer([weight])
        optimizer = accel.prepare_optimizer(duck)
        assert optimizer.step_hook is None  # no step hooks: told by the scale
        accel.backward(weight.sum())
        optimizer.step()
        assert not accel.optimizer_step_was_skipped(optimizer)
        optimizer.zero_grad()
        accel.backward(weight.sum() * float("inf"))
        optimizer.step()
        assert accel.optimizer_step_was_skipped(duck)
        assert duck.steps == 1

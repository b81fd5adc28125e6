"""Gradient accumulation and the backward pass.

Where things live:

- the sync flag (does this batch end an optimizer step?): ``accel.core.scope.scope()
  .sync_gradients``, set by :func:`accumulate` at the start of each block and left as it is
  after the block (so ``if accel.sync_gradients():`` after the block works, as in Accelerate);
- the accumulation counter: in the scope, per first model given to :func:`accumulate`
  (``scope().model_steps``, an entry per live model: nothing is written on the user's
  object), or in ``scope().accumulation_step`` when it is called without models;
  :func:`accumulation_step` and :func:`set_accumulation_step` read and write it (checkpoints
  save and restore it);
- the loss scale :func:`backward` applies: the mode's precision unit decides
  (``accel.precision``: fp16 multiplies by the scope's GradScaler, ``scope().grad_scaler``).
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch
from torch import nn

from accel.core.scope import scope
from accel.core.state import state
from accel.errors import ArgumentTypeError
from accel.parallel.engines.registry import ENGINES
from accel.training.model import _compiled_inner

__all__ = [
    "accumulate",
    "accumulation_step",
    "backward",
    "no_sync",
    "set_accumulation_step",
    "sync_gradients",
    "trigger_sync_in_backward",
]

def accumulation_step(model: nn.Module | None = None) -> int | None:
    """Batches since the last sync step, as counted by :func:`accumulate` (``None``: never ran).

    With a model, the count of ``accumulate(model, ...)``; without, the count of
    ``accumulate()`` called without models in this scope.

    Example:
        >>> with accel.accumulate(model):
        ...     pass
        >>> accumulation_step(model)  # 1 with gradient_accumulation_steps=4
        1
    """
    if model is None:
        return scope().accumulation_step
    return scope().model_steps.get(model)


def set_accumulation_step(step: int, model: nn.Module | None = None) -> None:
    """Set the count :func:`accumulation_step` reads (what ``load_state`` restores).

    Example:
        >>> set_accumulation_step(0, model)  # the next accumulate(model) starts a cycle
    """
    if model is None:
        scope().accumulation_step = step
    else:
        scope().model_steps.set(model, step)


def backward(loss: torch.Tensor, **kwargs: Any) -> None:
    """Backpropagate ``loss``: divided by the accumulation steps, scaled under fp16.

    Use it in place of ``loss.backward()``. With ``gradient_accumulation_steps=k > 1`` the
    loss is divided by ``k`` so the accumulated gradient is the mean over the ``k`` batches;
    under ``mixed_precision="fp16"`` (once an optimizer is prepared) it is multiplied by the
    GradScaler's scale, which the prepared optimizer removes before stepping.

    Args:
        loss: a scalar tensor.
        **kwargs: passed to :meth:`torch.Tensor.backward` (``retain_graph=True``...).

    Example:
        >>> loss = loss_fn(model(x), y)
        >>> accel.backward(loss)
    """
    if not isinstance(loss, torch.Tensor):
        raise ArgumentTypeError(
            f"accel.backward() takes the loss tensor, got {type(loss).__name__} {loss!r:.60}. "
            "Pass the tensor the loss function returned, e.g. `accel.backward(loss)`."
        )
    st = state()
    # the unit straight from the registry (the name was checked when the state was made, and
    # this runs every step): the loss divided by the accumulation steps and scaled by the
    # precision unit, or DeepSpeed's engine doing both
    ENGINES[st.strategy].backward(loss, st, kwargs)


def sync_gradients() -> bool:
    """Whether the current batch ends an optimizer step (gradients are synchronised).

    ``True`` outside :func:`accumulate`. After an ``accumulate`` block it keeps the block's
    value, e.g. to count optimizer steps.

    Example:
        >>> with accel.accumulate(model):
        ...     ...
        >>> if accel.sync_gradients():
        ...     completed_steps += 1
    """
    return scope().sync_gradients


def _require_module(op: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"accel.{op}() takes prepared models (torch.nn.Module), got "
            f"{type(model).__name__} {model!r:.60}. Pass the model, e.g. `accel.{op}(model)`."
        )


def _sync_off(model: nn.Module) -> contextlib.AbstractContextManager[Any] | None:
    """The context that turns off gradient sync for ``model`` (its engine's), or ``None``."""
    for engine in ENGINES.values():  # the one whose module this is
        context = engine.no_sync(model)
        if context is not None:
            return context
    inner = _compiled_inner(model)  # prepare_model(compile=True): the wrapper is inside
    return None if inner is None else _sync_off(inner)


class _Accumulate:
    """The context manager :func:`accumulate` returns (a class: nothing allocated per step
    beyond this object, and nothing at all for models without gradient sync)."""

    __slots__ = ("_exits", "_models")

    def __init__(self, models: tuple[nn.Module, ...]) -> None:
        self._models = models
        self._exits: list[contextlib.AbstractContextManager[Any]] | None = None

    def __enter__(self) -> bool:
        sc = scope()
        steps = state().gradient_accumulation_steps
        loaders = sc.active_loaders
        end = loaders[-1].end_of_dataloader if loaders else False
        models = self._models
        if end:
            step = 0
            if models:
                sc.model_steps.set(models[0], 0)
            else:
                sc.accumulation_step = 0
        elif models:  # batches since the last sync step
            step = sc.model_steps.advance(models[0], steps)
        else:
            step = ((sc.accumulation_step or 0) + 1) % steps
            sc.accumulation_step = step
        sync = step == 0
        sc.sync_gradients = sync
        if not sync:
            for model in models:
                context = _sync_off(model)
                if context is not None:
                    context.__enter__()
                    if self._exits is None:
                        self._exits = []
                    self._exits.append(context)
        return sync

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        exits = self._exits
        if exits is not None:
            self._exits = None
            for context in reversed(exits):
                context.__exit__(exc_type, exc, tb)


def accumulate(*models: nn.Module) -> contextlib.AbstractContextManager[bool]:
    """Accumulate gradients over ``gradient_accumulation_steps`` batches; yields the sync flag.

    Each entry counts one batch. The block is a sync step (the optimizer really steps, the
    scheduler advances, ``zero_grad`` clears) every ``gradient_accumulation_steps`` entries,
    and always on the last batch of the innermost prepared data loader being iterated (the
    count then restarts, so an epoch's remainder batches are not carried over). On the other
    entries DDP's gradient all-reduce is off for the given models (``model.no_sync()``; FSDP2
    modules use ``set_requires_gradient_sync``); plain modules need nothing. Put the forward
    pass inside the block: DDP decides in its forward whether the backward synchronises.

    The count lives on the first model given (or in the scope when no model is given).

    Args:
        *models: the prepared models trained in the block.

    Returns:
        A context manager whose value is ``True`` on sync steps.

    Example:
        >>> for x, y in loader:
        ...     with accel.accumulate(model):
        ...         accel.backward(loss_fn(model(x), y))
        ...         optimizer.step()
        ...         scheduler.step()
        ...         optimizer.zero_grad()
    """
    for model in models:
        _require_module("accumulate", model)
    return _Accumulate(models)


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Turn off gradient synchronisation across ranks for ``model`` in the block.

    DDP models use :meth:`DistributedDataParallel.no_sync` (also inside a
    ``prepare_model(compile=True)`` result), FSDP2 modules
    ``set_requires_gradient_sync(False)``; on other modules (one process) it does nothing.
    Gradients accumulate locally; the next backward outside the block synchronises them.

    Args:
        model: a prepared model.

    Returns:
        A context manager.

    Example:
        >>> with accel.no_sync(model):
        ...     accel.backward(loss_fn(model(x1), y1))  # local only
        >>> accel.backward(loss_fn(model(x2), y2))      # synchronises both
    """
    _require_module("no_sync", model)
    context = _sync_off(model)
    return contextlib.nullcontext() if context is None else context


def trigger_sync_in_backward(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Make the next backward synchronise gradients though its forward ran under no_sync.

    For a loop that runs several forwards under :func:`no_sync` and wants the last backward to
    all-reduce the accumulated gradients. On DDP it re-arms the reducer (experimental in
    Accelerate too: all parameters are taken as used, so ``find_unused_parameters`` models are
    not supported); FSDP2 modules turn ``set_requires_gradient_sync(True)`` on for the block;
    on other modules it does nothing.

    Args:
        model: a prepared model.

    Returns:
        A context manager.

    Example:
        >>> with accel.no_sync(model):
        ...     loss_a = loss_fn(model(x_a)); loss_b = loss_fn(model(x_b))
        >>> accel.backward(loss_a)                      # local only
        >>> with accel.trigger_sync_in_backward(model):
        ...     accel.backward(loss_b)                  # all-reduces the sum
    """
    _require_module("trigger_sync_in_backward", model)
    inner = _compiled_inner(model)
    if inner is not None:  # prepare_model(compile=True): the wrapper is inside
        model = inner
    for engine in ENGINES.values():
        context = engine.sync_on(model)
        if context is not None:
            return context
    return contextlib.nullcontext()

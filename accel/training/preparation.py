"""``prepare(*objects)``: prepare models, optimizers, schedulers and data loaders in one call."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from accel.core.agreement import agreed_once, settings_of
from accel.core.state import state
from accel.parallel.engines.registry import engine_for
from accel.parallel.fsdp_params import adopt_sharded_parameters
from accel.training.model import _mark, prepare_model
from accel.training.optim import prepare_optimizer
from accel.training.scheduling import prepare_scheduler

__all__ = ["prepare"]


def _kind(obj: Any) -> int:
    """Preparation order: models, then optimizers, then schedulers and loaders, then rest."""
    if isinstance(obj, nn.Module):
        return 0
    if isinstance(obj, torch.optim.Optimizer):
        return 1
    if isinstance(obj, LRScheduler | DataLoader):
        return 2
    return 3


def _prepare_one(obj: Any) -> Any:
    if isinstance(obj, nn.Module):
        return prepare_model(obj)
    if isinstance(obj, torch.optim.Optimizer):
        return prepare_optimizer(obj)
    if isinstance(obj, LRScheduler):
        return prepare_scheduler(obj)
    if isinstance(obj, DataLoader):
        # accel.data imports lazily: a script without loaders does not load it.
        return importlib.import_module("accel.data").prepare_data_loader(obj)
    return obj


def prepare(*objects: Any) -> Any:
    """Prepare each object for the run with the ``prepare_*`` function of its type.

    Models go through :func:`accel.prepare_model`, optimizers :func:`accel.prepare_optimizer`,
    LR schedulers :func:`accel.prepare_scheduler` and data loaders
    :func:`accel.prepare_data_loader`, each with default options (call those functions for
    others); anything else is returned as it is. Models are prepared first, then optimizers,
    then schedulers, whatever the argument order, so a scheduler finds its prepared
    optimizer. Results come back in the argument order. An optimizer made on a model that
    is sharded here (``strategy="fsdp"``) is moved onto the sharded parameters (Accelerate's
    FSDP2 behaviour); an optimizer with state for them is refused. Every rank must call it:
    the ranks first agree on the block's settings and the objects' kinds with one small
    collective (the engine's own settings where it prepares them together, as DeepSpeed's
    config after its ``"auto"`` filling); a difference is a ``ConfigError`` on every rank.

    Args:
        *objects: models, optimizers, schedulers, data loaders, in any order.

    Returns:
        A tuple of the prepared objects, or the prepared object itself when given one.

    Example:
        >>> model, optimizer, loader, scheduler = accel.prepare(
        ...     model, optimizer, loader, scheduler
        ... )
    """
    st = state()
    together = engine_for(st.strategy).prepare(objects, _prepare_one, _mark)
    if together is not None:  # DeepSpeed: the model and its optimizer into one engine
        return _single(together)
    results: list[Any] = list(objects)
    kinds = {**settings_of(st), "objects": [type(obj) for obj in objects]}
    with agreed_once("accel.prepare()", kinds, device=st.device):  # one collective per call
        for index in sorted(range(len(objects)), key=lambda i: _kind(objects[i])):
            if isinstance(objects[index], torch.optim.Optimizer):  # after every model
                adopt_sharded_parameters(objects[index], objects)
            results[index] = _prepare_one(objects[index])
    return _single(results)


def _single(results: list[Any]) -> Any:
    if len(results) == 1:
        return results[0]
    return tuple(results)

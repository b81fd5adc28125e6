"""The DDP engine (``strategy="ddp"``, the default with several processes): the model wrapped
in torch's ``DistributedDataParallel`` (``accel.parallel.ddp`` holds its options and hooks).

Example:
    >>> with accel.distributed(strategy="ddp"):
    ...     model = accel.prepare_model(net)   # a DDP wrapper on several processes
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel.core.state import ProcessState
from accel.parallel.ddp import ddp_options, make_ddp, note_ignored
from accel.parallel.ddp_teardown import watch_reducers
from accel.parallel.engines.base import Engine, Placed

__all__ = ["DDP"]


@attrs.frozen
class DDP(Engine):
    """``strategy="ddp"``: each process a replica, gradients all-reduced by DDP's reducer.

    Example:
        >>> engine_for("ddp").inner(DistributedDataParallel(net)) is net
        True
    """

    name: ClassVar[str] = "ddp"

    def stage_options(self, st: ProcessState, given: Mapping[str, Any]) -> dict[str, Any]:
        if st.dp_world_size > 1 and given:
            note_ignored(ddp_options(st.options, given), "pipeline parallelism")
        return {}

    def wrap(self, placed: Placed, st: ProcessState, evaluation_mode: bool) -> nn.Module:
        model, options = placed.model, placed.ddp
        assert options is not None  # set by place
        reason = _no_ddp_reason(st.world_size, evaluation_mode, model)
        if reason:
            note_ignored(options, reason)
            return model
        device = st.device
        placement: dict[str, Any] = {}
        if device.type == "cuda" and device.index is not None:
            placement = {"device_ids": [device.index], "output_device": device.index}
        watch_reducers()
        return make_ddp(model, options, placement)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        return model.no_sync() if isinstance(model, DistributedDataParallel) else None

    def sync_on(self, model: nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        return _trigger_sync(model) if isinstance(model, DistributedDataParallel) else None

    def inner(self, model: nn.Module) -> nn.Module | None:
        if isinstance(model, DistributedDataParallel):
            inner: nn.Module = model.module
            return inner
        return None


def _no_ddp_reason(world_size: int, evaluation_mode: bool, model: nn.Module) -> str:
    """Why no DDP wrapper applies, or ``""`` when one does."""
    if world_size == 1:
        return "one process"
    if evaluation_mode:
        return "evaluation_mode=True"
    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameter"
    return ""




@contextlib.contextmanager
def _trigger_sync(model: DistributedDataParallel) -> Iterator[None]:
    old_backward = model.require_backward_grad_sync
    old_forward = model.require_forward_param_sync
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    # The forward ran under no_sync, so the reducer was not told to expect a backward; tell it
    # now, as DDP's own forward does on a sync step (all parameters are taken as used).
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync = old_backward
        model.require_forward_param_sync = old_forward

"""The GradScaler's mechanics: made per scope, unscaled over meshes, overflow agreed, saved.

The fp16 unit (``accel.precision.half.Float16``) drives these; they take the scaler as an
argument and know no mode. The scaler itself is the scope's (``scope().grad_scaler``): one per
``distributed()`` scope, made by the first optimizer prepared under a mode that scales the
loss, or by :func:`load_scaler_state_dict`, and saved by ``save_state`` when there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from accel.core.scope import scope
from accel.core.state import state
from accel.precision.base import Layouts, StepRecord

__all__ = [
    "agree_on_overflow",
    "load_scaler_state_dict",
    "mesh_unscale",
    "scaled_step",
    "scaler_state_dict",
    "scope_scaler",
]


def scope_scaler() -> torch.amp.GradScaler:
    """The scope's GradScaler, made on the state's device type (CPU included) if none yet.

    Example:
        >>> scope_scaler() is scope_scaler()
        True
    """
    sc = scope()
    scaler: torch.amp.GradScaler | None = sc.grad_scaler
    if scaler is None:
        scaler = sc.grad_scaler = torch.amp.GradScaler(state().device.type)
    return scaler


def mesh_unscale(scaler: torch.amp.GradScaler, optimizer: Any, layouts: Layouts | None) -> None:
    """``scaler.unscale_(optimizer)``, also where gradients of several layouts sit together.

    A tensor-parallel model's optimizer holds plain gradients (layers left whole, the same on
    every TP rank) beside DTensor gradients on one or two meshes; torch's unscale takes one
    kind per call. Under an N-D mesh (``layouts`` given) each layout group is unscaled on its
    own (with torch's own per-group step, so its overflow check reduces over the group's mesh)
    and the overflow flags are merged per device, as ``unscale_`` records them.

    Example:
        >>> mesh_unscale(scaler, optimizer, layout_groups)
    """
    if layouts is None or not scaler.is_enabled():
        scaler.unscale_(optimizer)
        return
    groups = layouts([p for group in optimizer.param_groups for p in group["params"]])
    if len(groups) <= 1:
        scaler.unscale_(optimizer)
        return
    from torch.amp.grad_scaler import OptState

    record = scaler._per_optimizer_states[id(optimizer)]
    if record["stage"] is not OptState.READY:
        scaler.unscale_(optimizer)  # torch says what is wrong (unscaled twice, after step)
        return
    scale = scaler._scale
    assert scale is not None
    inv_scale = scale.double().reciprocal().float()
    found: dict[torch.device, torch.Tensor] = {}
    for group in groups:
        proxy = SimpleNamespace(param_groups=[{"params": group}])
        flag = torch.zeros((), dtype=torch.float32, device=scale.device)
        for device, value in scaler._unscale_grads_(
            proxy, inv_scale, flag, False  # type: ignore[arg-type]
        ).items():
            found[device] = value if device not in found else torch.maximum(found[device], value)
    record["found_inf_per_device"] = found
    record["stage"] = OptState.UNSCALED


def agree_on_overflow(
    scaler: torch.amp.GradScaler, optimizer: Any, layouts: Layouts, *, unscaled: bool
) -> None:
    """Make every rank of an N-D mesh skip the step when any rank's gradients overflowed.

    Each rank checks only its own pieces of sharded gradients (an inf in one TP or FSDP shard
    is seen by one rank), and torch's check reduces over one mesh per call; without this, one
    rank would skip the step while the others took it. One all-reduce of one flag per fp16
    step, only under a mesh. Must be called on every rank.

    Example:
        >>> agree_on_overflow(scaler, optimizer, layout_groups, unscaled=False)
    """
    import torch.distributed as dist

    if not unscaled:
        mesh_unscale(scaler, optimizer, layouts)  # records found_inf per device (step reuses it)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    if not found:  # no gradient on this rank: torch's GradScaler.step refuses it next
        return
    values = list(found.values())
    flag = torch.stack([v.to(values[0].device).reshape(()) for v in values]).amax()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    for value in values:
        value.copy_(flag.to(value.device))


def scaled_step(
    record: StepRecord, closure: Callable[[], float] | None, layouts: Layouts | None
) -> Any:
    """Step ``record.optimizer`` through ``record.scaler``: unscale (once), agree on overflow
    under a mesh, skip on inf/nan, update the scale, and record whether the step was skipped.

    Example:
        >>> scaled_step(prepared, None, None)
    """
    scaler = record.scaler
    assert scaler is not None
    optimizer = record.optimizer
    if layouts is not None:
        agree_on_overflow(scaler, optimizer, layouts, unscaled=record.grads_unscaled)
    if record.step_hook is not None:
        record.step_ran = False
        result = scaler.step(optimizer) if closure is None else scaler.step(optimizer, closure)
        scaler.update()
        record.step_was_skipped = not record.step_ran
    else:  # not a torch Optimizer (no hooks): a skipped step lowers the scale
        before = scaler.get_scale()
        result = scaler.step(optimizer) if closure is None else scaler.step(optimizer, closure)
        scaler.update()
        record.step_was_skipped = scaler.get_scale() < before
    record.grads_unscaled = False
    return result


def scaler_state_dict() -> dict[str, Any] | None:
    """The scope's GradScaler state (scale, growth tracker...), or ``None`` if it has none.

    Example:
        >>> saved = scaler_state_dict()
        >>> load_scaler_state_dict(saved)  # later, e.g. after a restart
    """
    scaler = scope().grad_scaler
    if scaler is None:
        return None
    result: dict[str, Any] = scaler.state_dict()
    return result


def load_scaler_state_dict(state_dict: dict[str, Any] | None) -> None:
    """Restore the scope's GradScaler from :func:`scaler_state_dict`'s value.

    ``None`` or an empty dict (saved without fp16) leaves it as it is. When the scope has no
    scaler yet (no optimizer prepared under fp16), one is made on the state's device.

    Example:
        >>> load_scaler_state_dict(saved)
    """
    if not state_dict:
        return
    scope_scaler().load_state_dict(state_dict)

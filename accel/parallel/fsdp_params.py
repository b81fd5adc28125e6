"""Parameters that FSDP2 sharding replaced: marks, the optimizer check and the remap.

``fully_shard`` swaps each parameter of a module for a new DTensor parameter. An optimizer made
before sharding still holds the old ones, and stepping it would never change the model. Each
replaced (old) parameter carries ``_accel_fsdp_replaced = (weakref to the model, its name)``,
set by :func:`mark_replaced`; :func:`check_optimizer_parameters` (``prepare_optimizer``) and
:func:`adopt_sharded_parameters` (``accel.prepare(model, optimizer)``) read it, at prepare time
only. Also :func:`plain_norm` for clipping DTensor gradients, and :func:`set_gradient_sync`,
the per-step gradient-sync switch for ``accel.accumulate`` (its FSDP modules are listed once,
in the ``_accel_fsdp_sync_targets`` entry of the model's ``__dict__``, with
FSDP2's parameter groups whose flags it writes).

This module does not import ``torch.distributed``.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import attrs
import torch
from torch import nn

from accel.core.scope import ScopeSlot
from accel.core.state import state
from accel.errors import StaleParametersError

__all__ = [
    "adopt_sharded_parameters",
    "check_optimizer_parameters",
    "clip_by_total_norm",
    "layout_groups",
    "mark_replaced",
    "plain_norm",
    "set_gradient_sync",
]

_REPLACED = "_accel_fsdp_replaced"  # attribute of a parameter that fully_shard replaced
_SYNC_TARGETS = "_accel_fsdp_sync_targets"  # model.__dict__ entry: its FSDP param groups


def _sync_targets(model: nn.Module) -> tuple[Any, ...] | None:
    """FSDP2's parameter groups in ``model``'s tree (itself included), listed on first use.

    These hold the two flags ``set_requires_gradient_sync`` sets (``reduce_grads`` and
    ``all_reduce_grads``, on every group of every FSDP module below it). ``None`` when they
    cannot be listed: ``model`` is not torch's ``FSDPModule`` (an object that only has the
    method) or torch's FSDP2 keeps them differently; :func:`set_gradient_sync` then calls the
    method as it is.
    """
    if _SYNC_TARGETS not in model.__dict__:
        model.__dict__[_SYNC_TARGETS] = _param_groups(model)
    targets: tuple[Any, ...] | None = model.__dict__[_SYNC_TARGETS]
    return targets


def _param_groups(model: nn.Module) -> tuple[Any, ...] | None:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded if model was sharded
    module_type = getattr(fsdp, "FSDPModule", None)
    if module_type is None or not isinstance(model, module_type):
        return None
    groups: list[Any] = []
    for module in model.modules():
        if not isinstance(module, module_type):
            continue
        get_state = getattr(module, "_get_fsdp_state", None)
        found = getattr(get_state(), "_fsdp_param_groups", None) if callable(get_state) else None
        if not isinstance(found, list):
            return None
        for group in found:
            if not (hasattr(group, "reduce_grads") and hasattr(group, "all_reduce_grads")):
                return None
            groups.append(group)
    return tuple(groups)


def set_gradient_sync(model: nn.Module, requires_sync: bool) -> None:
    """``model.set_requires_gradient_sync(requires_sync)`` in a few attribute writes.

    FSDP2's own call lists every submodule of the model and looks up each FSDP module's state
    on every call (about 2 us per FSDP module, so milliseconds per step for a model of
    thousands of tensors, twice per accumulation step); here its parameter groups are listed
    once (the first call) and each one's two flags are written, the same flags FSDP2's call
    sets (``tests/multiproc/test_step_calls.py`` compares them). Modules sharded after
    that first call are not seen.

    Example:
        >>> set_gradient_sync(model, False)  # backward keeps the gradients local
        >>> set_gradient_sync(model, True)
    """
    groups = _sync_targets(model)
    if groups is None:
        model.set_requires_gradient_sync(requires_sync)  # type: ignore[operator]
        return
    for group in groups:
        group.reduce_grads = requires_sync
        group.all_reduce_grads = requires_sync


def mark_replaced(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    """Mark each parameter of ``before`` (names to parameters) that ``model`` no longer holds.

    Example:
        >>> before = dict(model.named_parameters())
        >>> fully_shard(model)
        >>> mark_replaced(model, before)
    """
    after = dict(model.named_parameters())
    owner = weakref.ref(model)
    for name, old in before.items():
        if after.get(name) is not old:
            setattr(old, _REPLACED, (owner, name))


def _replaced(param: object) -> tuple[nn.Module, str] | None:
    """``(model, name)`` when ``param`` is a parameter that ``fully_shard`` replaced."""
    record = getattr(param, _REPLACED, None)
    if record is None:
        return None
    model = record[0]()
    return None if model is None else (model, record[1])


def _optimizer_params(optimizer: Any) -> list[object]:
    groups = getattr(optimizer, "param_groups", None) or []
    return [param for group in groups for param in group.get("params", [])]


_FIX = (
    "Create the optimizer from the prepared model's parameters: "
    "`model = accel.prepare_model(model); optimizer = torch.optim.AdamW(model.parameters())`, "
    "or pass both together, `model, optimizer = accel.prepare(model, optimizer)`, which moves "
    "a fresh optimizer onto the sharded parameters."
)


def check_optimizer_parameters(optimizer: Any) -> None:
    """Refuse an optimizer that holds parameters ``fully_shard`` replaced (prepare time only).

    Args:
        optimizer: the user's optimizer.

    Raises:
        StaleParametersError: some of its parameters belong to a model sharded since the
            optimizer was made; stepping it would update tensors the model no longer uses.

    Example:
        >>> check_optimizer_parameters(torch.optim.AdamW(model.parameters()))  # after sharding
    """
    stale = [found for found in map(_replaced, _optimizer_params(optimizer)) if found]
    if stale:
        names = [name for _, name in stale]
        raise StaleParametersError(
            f"The optimizer {type(optimizer).__name__!r} holds {len(stale)} parameters that "
            f"sharding (strategy='fsdp' or a tp_plan) replaced in {type(stale[0][0]).__name__!r} "
            f"(e.g. {names[:3]!r}): it was made before prepare_model, and stepping it would "
            f"never change the model. {_FIX}"
        )


def adopt_sharded_parameters(optimizer: Any, models: Iterable[object]) -> None:
    """Point ``optimizer`` at the sharded parameters of ``models`` that replaced its own.

    What ``accel.prepare(model, optimizer)`` does for an optimizer made on the unsharded model
    (Accelerate's FSDP2 flow): each parameter ``fully_shard`` replaced in one of ``models`` is
    swapped for its sharded successor in the param groups; one a pipeline split moved to
    another rank's stage is dropped. Parameters replaced in a model
    that is not in ``models`` are left (``prepare_optimizer`` then refuses them).

    Args:
        optimizer: the user's optimizer.
        models: the models prepared in the same ``accel.prepare`` call.

    Raises:
        StaleParametersError: the optimizer already has state (e.g. moments after a step, or
            a loaded state dict) for a replaced parameter: that state has the unsharded shape.

    Example:
        >>> adopt_sharded_parameters(optimizer, [model])
    """
    ids = {id(model) for model in models}
    opt_state = getattr(optimizer, "state", {})
    for group in getattr(optimizer, "param_groups", None) or []:
        params = group.get("params", [])
        for index, param in enumerate(params):
            found = _replaced(param)
            if found is None or id(found[0]) not in ids:
                continue
            if opt_state.get(param):
                raise StaleParametersError(
                    f"The optimizer {type(optimizer).__name__!r} already has state for "
                    f"parameter {found[1]!r}, which sharding (FSDP or TP) replaced with its shard: "
                    f"that state has the unsharded shape. {_FIX} Load optimizer state after "
                    "preparing (e.g. with `accel.load_state`)."
                )
            try:
                params[index] = found[0].get_parameter(found[1])
            except AttributeError:  # another pipeline stage's parameter: not this rank's
                params[index] = None
        group["params"] = [param for param in params if param is not None]


def plain_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor: a DTensor norm (FSDP2 gradients) becomes its value.

    ``torch.nn.utils.clip_grad_norm_`` over DTensor gradients already reduces the norm over
    every shard and returns it as a replicated DTensor; this gives the same value as a plain
    tensor, equal on every rank. Must be called on every rank for a non-replicated DTensor.

    Example:
        >>> plain_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        tensor(0.8123)
    """
    if type(norm) is torch.Tensor:
        return norm
    full = getattr(norm, "full_tensor", None)
    return norm if full is None else full()


def layout_groups(params: list[Any]) -> list[list[Any]]:
    """``params`` with gradients, grouped by their mesh and placements (plain tensors
    together), in first-seen order: the same on every rank.

    Example:
        >>> [len(group) for group in layout_groups(list(model.parameters()))]
        [4, 8, 2]
    """
    layouts = _LAYOUTS.get_or_create(_Layouts)
    groups: dict[int, list[Any]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault(_layout(param, layouts), []).append(param)
    return list(groups.values())


@attrs.define
class _Layouts:
    """The block's layout numbers: per parameter (by id, checked against a weak reference, so
    a new tensor that reuses a dead one's id is worked out again), and per (mesh, placements)."""

    by_param: dict[int, tuple[weakref.ref[Any], int]] = attrs.field(factory=dict)
    numbers: dict[tuple[object, tuple[object, ...]], int] = attrs.field(factory=dict)


_LAYOUTS: ScopeSlot[_Layouts] = ScopeSlot("accel.parallel.fsdp_params layout numbers")


def _layout(param: Any, layouts: _Layouts) -> int:
    """A number for the mesh and placements of a DTensor parameter (0 for a plain one), worked
    out once per parameter and block: a DTensor's attributes and placements are slow to read
    and hash (a copy of the parameter, with another id, works it out again). Kept in the
    block's scope, nothing on the parameter."""
    cached = layouts.by_param.get(id(param))
    if cached is not None and cached[0]() is param:
        return cached[1]
    mesh = getattr(param, "device_mesh", None)
    number = 0 if mesh is None else layouts.numbers.setdefault(
        (mesh, tuple(param.placements)), len(layouts.numbers) + 1
    )
    layouts.by_param[id(param)] = (weakref.ref(param), number)
    return number


def clip_by_total_norm(
    params: list[Any], max_norm: float | None, norm_type: float
) -> torch.Tensor:
    """The total gradient norm of ``params`` over every rank and mesh dim (clipped to
    ``max_norm`` unless it is ``None``), as a plain tensor, the same on every rank.

    torch's ``clip_grad_norm_`` takes one kind of gradient; a tensor-parallel model mixes
    plain gradients (layers left whole), DTensors on the ``tp`` mesh and, under FSDP, DTensors
    on the data-parallel or the 2-D mesh. Each such group's norm is reduced over its own mesh,
    then the norms are combined. Every rank must call it.

    Example:
        >>> norm = clip_by_total_norm(list(model.parameters()), 1.0, 2.0)
    """
    st = state()
    groups = layout_groups(params) if st.mesh is not None else []
    if len(groups) <= 1:
        if max_norm is None:
            grads = [p.grad for p in params if p.grad is not None]
            return plain_norm(torch.nn.utils.get_total_norm(grads, norm_type))
        return plain_norm(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type))
    norms = [
        plain_norm(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type))
        for group in groups
    ]
    total: torch.Tensor = torch.linalg.vector_norm(
        torch.stack([n.to(norms[0].device) for n in norms]), norm_type
    )
    if max_norm is not None:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total

"""``save_state``/``load_state`` under DeepSpeed, in accel's own format by parameter name.

:func:`plain_objects` gives ``accel.checkpoint`` stand-ins for the engine and its prepared
optimizer that look like one plain process's model and torch optimizer, so a DeepSpeed
checkpoint is byte for byte the format a plain (or DDP) run writes, and a plain or FSDP
checkpoint loads into DeepSpeed:

* the model stand-in is an ``nn.Module`` with the user's module's structure (names, ties,
  buffers) whose parameters hold the fp32 master weights
  (``deepspeed.utils.safe_get_full_fp32_param``; the parameter itself where DeepSpeed keeps
  no master copy). Its ``load_state_dict`` writes the values back: the master weights
  (``safe_set_full_fp32_param``; under ZeRO-3 ``safe_set_local_fp32_param`` with this rank's
  padded slice, see :func:`_local_partition`) and the engine's own (bf16/fp16 or fp32)
  weights, a ZeRO-3 partition through ``GatheredParameters``;
* the optimizer stand-in is a torch optimizer over those parameters, with the user's param
  groups (the ones passed to ``accel.prepare``) and their hyper-parameters, and per
  parameter the step count and the full states (``safe_get_full_optimizer_state``: Adam's
  ``exp_avg``, ``exp_avg_sq``...). Its ``load_state_dict`` creates DeepSpeed's flat optimizer
  state when the engine has not stepped yet, then sets every parameter's state
  (``safe_set_full_optimizer_state``; ``safe_set_local_optimizer_state`` under ZeRO-3), the
  step counts and the hyper-parameters.

Every rank calls these (each ``safe_get`` is a collective), in the same order: the module's
parameters, then the optimizer's groups. Nothing here is pickled or read from DeepSpeed's
own checkpoint files.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from accel.core.scope import scope
from accel.errors import CheckpointError
from accel.parallel.deepspeed.engine import EngineRun, current_run

__all__ = ["plain_objects"]


def _utils() -> Any:
    return importlib.import_module("deepspeed.utils")


def _unique(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Each parameter object once, by its first name, in the module's order."""
    yield from module.named_parameters()


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    shape = getattr(param, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(param.shape)


def _full_param(param: nn.Parameter) -> torch.Tensor:
    """The fp32 master weight of ``param`` in full, on the CPU (a collective under ZeRO)."""
    value = _utils().safe_get_full_fp32_param(param) if param.requires_grad else None
    if value is None:
        if hasattr(param, "ds_id"):  # frozen under ZeRO-3: its (low precision) weight
            zero = importlib.import_module("deepspeed").zero
            with zero.GatheredParameters([param], modifier_rank=None):
                value = param.detach().clone()
        else:
            value = param.detach()
    value = value.detach().reshape(_shape(param)).to("cpu", copy=True)
    return value.float() if value.is_floating_point() else value


def _local_partition(param: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    """The part of the full ``value`` that this rank's ZeRO-3 partition of ``param`` holds.

    DeepSpeed gives every rank ``ceil(numel / ranks)`` elements, the last rank's ending in
    zero padding past the end of the parameter (or padding only: a 2-value bias on 3 ranks).
    DeepSpeed 0.19's ``safe_set_full_*`` narrow the unpadded full value at ``rank * size``,
    which raises on the last rank whenever the rank count does not divide the size (80
    values on 3 ranks: 27 each, the third from 54 to 81) while the other ranks go on into
    the next collective. Its ``safe_set_local_*`` take this padded slice instead, and make
    no collective.
    """
    local = param.ds_tensor  # type: ignore[attr-defined]  # DeepSpeed's partition
    size = int(getattr(local, "ds_numel", local.numel()))  # its data may be offloaded
    rank = torch.distributed.get_rank(group=getattr(param, "ds_process_group", None))
    flat = value.detach().reshape(-1)
    start = min(rank * size, flat.numel())
    stop = min(start + size, flat.numel())
    out = torch.zeros(size, dtype=torch.float32, device=local.device)
    out[: stop - start] = flat[start:stop]
    return out


def _set_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Write ``value`` (full, fp32) as ``param``'s master weight and its engine weight."""
    if param.requires_grad and hasattr(param, "ds_id"):  # ZeRO-3: this rank's slice
        _utils().safe_set_local_fp32_param(param, _local_partition(param, value))
    elif param.requires_grad:
        _utils().safe_set_full_fp32_param(param, value.to(param.device))
    if hasattr(param, "ds_id"):  # ZeRO-3: every rank holds the value; rank 0's is kept
        zero = importlib.import_module("deepspeed").zero
        with zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.data.copy_(value.reshape(param.shape))
    else:
        with torch.no_grad():
            param.data.copy_(value.reshape(param.shape))


def _mirror(module: nn.Module, params: dict[int, nn.Parameter],
            memo: dict[int, nn.Module], root: nn.Module | None = None) -> nn.Module:
    """An ``nn.Module`` tree with ``module``'s names, whose parameters are ``params`` (by
    the id of the parameter they stand for: ties stay ties) and whose buffers are its own."""
    out = root if root is not None else nn.Module()
    memo[id(module)] = out
    for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
        out.register_parameter(name, params[id(param)])
    persistent = {n for n, _ in module.named_buffers(recurse=False)} - getattr(
        module, "_non_persistent_buffers_set", set())
    for name, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
        out.register_buffer(name, buffer, persistent=name in persistent)
    for name, child in module.named_children():
        known = memo.get(id(child))
        out.add_module(name, known if known is not None else _mirror(child, params, memo))
    return out


class _ModelStandIn(nn.Module):
    """The engine's model as one plain process holds it (fp32 master weights)."""

    def __init__(self, run: EngineRun, params: dict[int, nn.Parameter]) -> None:
        super().__init__()
        self._run = run
        self._of = params
        _mirror(run.engine.module, params, {}, root=self)

    def load_state_dict(
        self, state_dict: Any, strict: bool = True, assign: bool = False
    ) -> Any:
        result = super().load_state_dict(state_dict, strict=strict)
        for _, param in _unique(self._run.engine.module):  # every rank, in the same order
            _set_param(param, self._of[id(param)].detach())
        return result


def _basic(run: EngineRun) -> Any:
    """The torch optimizer DeepSpeed steps (the user's, inside ZeRO's wrapper)."""
    if run.user_optimizer is not None:
        return run.user_optimizer
    inner = getattr(run.engine, "basic_optimizer", None)
    return inner if inner is not None else run.engine.optimizer


def _flat_states(run: EngineRun) -> list[torch.Tensor]:
    """The tensors DeepSpeed's torch optimizer keeps state for (flat fp32 partitions)."""
    zero = run.engine.optimizer
    for attribute in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups",
                      "fp32_groups_flat_partition"):
        flats = getattr(zero, attribute, None)
        if isinstance(flats, list) and flats:
            return list(flats)
    return [p for g in _basic(run).param_groups for p in g["params"]]


def _per_param(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _full_state(run: EngineRun, param: nn.Parameter, key: str) -> torch.Tensor | None:
    value = _utils().safe_get_full_optimizer_state(param, key)
    if value is None:
        value = _basic(run).state.get(param, {}).get(key)
    if not isinstance(value, torch.Tensor):
        return None
    return value.detach().reshape(_shape(param)).to("cpu", copy=True)


class _OptimizerStandIn(torch.optim.Optimizer):
    """The engine's optimizer as one plain process's torch optimizer holds it."""

    def __init__(self, run: EngineRun, groups: list[list[nn.Parameter]],
                 params: dict[int, nn.Parameter]) -> None:
        basic = _basic(run)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in basic.param_groups]
        super().__init__(
            [{**h, "params": [params[id(p)] for p in g]}
             for h, g in zip(hyper, groups, strict=True)],
            dict(getattr(basic, "defaults", {})),
        )
        self._run = run
        self._groups = groups

    def fill(self) -> None:
        """This optimizer's state from the engine's (collectives: every rank)."""
        run = self._run
        entries = [e for e in _basic(run).state.values() if isinstance(e, dict) and e]
        if not entries:
            return  # no step yet: no state, as a plain optimizer
        keys = [k for k, v in entries[0].items() if _per_param(v)]
        scalars = {k: v for k, v in entries[0].items() if not _per_param(v)}
        for group, own in zip(self._groups, self.param_groups, strict=True):
            for param, stand_in in zip(group, own["params"], strict=True):
                entry: dict[str, Any] = {}
                for key in keys:
                    value = _full_state(run, param, key)
                    if value is not None:
                        entry[key] = value
                if entry:
                    self.state[stand_in] = {
                        **{k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in scalars.items()},
                        **entry,
                    }

    def step(self, closure: Any = None) -> Any:
        raise CheckpointError("The DeepSpeed checkpoint stand-in optimizer does not step.")

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict(state_dict)
        run = self._run
        basic = _basic(run)
        for own, live in zip(self.param_groups, basic.param_groups, strict=True):
            live.update({k: v for k, v in own.items() if k != "params"})
        saved = [(p, self.state.get(s)) for g, o in zip(self._groups, self.param_groups,
                                                      strict=True)
                 for p, s in zip(g, o["params"], strict=True)]
        entries = [e for _, e in saved if e]
        if not entries:
            return
        keys = [k for k, v in entries[0].items() if _per_param(v)]
        scalars = {k: v for k, v in entries[0].items() if not _per_param(v)}
        self._make_state(keys, scalars)
        utils = _utils()
        for param, entry in saved:  # every rank, in the same order
            if not entry:
                continue
            for key in keys:
                value = entry[key].detach().reshape(_shape(param))
                if hasattr(param, "ds_id"):  # ZeRO-3: this rank's slice (no collective)
                    if param.requires_grad:
                        utils.safe_set_local_optimizer_state(
                            param, _local_partition(param, value), key)
                elif getattr(param, "_hp_mapping", None) is not None:
                    utils.safe_set_full_optimizer_state(param, value.to(param.device), key)
                else:  # no ZeRO: the torch optimizer keeps state by parameter
                    basic.state[param][key] = value.to(param.device, copy=True)

    def _make_state(self, keys: list[str], scalars: dict[str, Any]) -> None:
        """DeepSpeed's flat state, created as the torch optimizer's first step would
        (zeros, then overwritten), with the saved step counts; ZeRO-1/2 relinked to it."""
        run = self._run
        basic = _basic(run)
        for flat in _flat_states(run):
            entry = basic.state.setdefault(flat, {})
            for key, value in scalars.items():
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            for key in keys:
                if key not in entry:
                    entry[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        zero = run.engine.optimizer
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2, bf16
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()


def _is_engine_model(obj: Any, run: EngineRun) -> bool:
    return obj is run.engine or obj is run.engine.module


def _is_engine_optimizer(obj: Any, run: EngineRun) -> bool:
    if not isinstance(getattr(obj, "param_groups", None), list):
        return False  # a scheduler holds the optimizer too
    inner = getattr(obj, "optimizer", None)
    basic = _basic(run)
    return obj is basic or inner is basic or obj is run.engine.optimizer


def plain_objects(objects: dict[str, Any], *, gather: bool) -> dict[str, Any]:
    """``objects`` with the engine and its optimizer replaced by plain stand-ins.

    With ``gather`` (``save_state``) the stand-ins hold the full fp32 weights and optimizer
    state (collectives); without (``load_state``) they hold zeros of the right shapes, and
    their ``load_state_dict`` writes into the engine. Every rank must call it.

    Raises:
        CheckpointError: a save in the middle of an accumulation cycle (DeepSpeed keeps the
            unreduced gradients inside its engine).

    Example:
        >>> plain_objects({"model": engine, "optimizer": optimizer}, gather=True)
        {'model': _ModelStandIn(...), 'optimizer': _OptimizerStandIn (...)}
    """
    run = current_run()
    module = run.engine.module
    if gather:
        counts = scope().model_steps
        for name, obj in objects.items():
            step = counts.get(obj) if isinstance(obj, nn.Module) else None
            if _is_engine_model(obj, run) and step:
                raise CheckpointError(
                    f"save_state({name}=...) was called in the middle of a gradient "
                    f"accumulation cycle (batch {step} of the cycle) under DeepSpeed, whose "
                    "unreduced gradients live inside its engine and cannot be saved. Save on a "
                    "sync step: `if accel.sync_gradients(): accel.save_state(...)`."
                )
    params: dict[int, nn.Parameter] = {}
    for _, param in _unique(module):
        value = _full_param(param) if gather else torch.zeros(
            _shape(param), dtype=torch.float32 if param.is_floating_point() else param.dtype)
        params[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
    model = _ModelStandIn(run, params)
    optimizer = _OptimizerStandIn(run, run.groups, params)
    if gather:
        optimizer.fill()
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, nn.Module) and _is_engine_model(obj, run):
            out[name] = model
        elif _is_engine_optimizer(obj, run):
            out[name] = optimizer
        else:
            out[name] = obj
    return out

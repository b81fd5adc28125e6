"""Checkpoints of pipelined models: each stage writes its pieces under their global names.

A model ``prepare_model`` split into pipeline stages holds only its stages' parameters on each
rank, so its state (and its optimizer's) is saved in the sharded format of
:mod:`accel.checkpoint.sharded.pieces`: every tensor becomes a piece (a whole tensor at offset
0 for a plain one, the FSDP shard of a DTensor), written by the first rank of its stage's
data-parallel group, and the structure file the writer keeps is the union of every stage's
structure (gathered from every rank, the same collective on each). The optimizer is keyed by
parameter names. A parameter tied across stages is written once, by its owner, under its
first name (``extra["tied"]`` names the others), as a one-process checkpoint stores a tie.
:mod:`accel.checkpoint.sharded.reshard` loads it into any layout: a plain
model assembles the full tensors; a pipelined target keeps only the names its stages hold
(:func:`only_local`), whatever pipeline layout saved them.

Example:
    >>> accel.save_state("ckpt", model=model, optimizer=optimizer)  # PP2: each stage its own
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel._files.objects import plan_object
from accel._files.writer import PlannedFile
from accel.checkpoint.sharded.pieces import (
    SHARD_REF,
    SHARDS,
    _local_pieces,
    inner_optimizer,
)
from accel.core.state import state
from accel.core.tree import dtensor_type
from accel.errors import CheckpointError
from accel.training.model import unwrap_model
from accel.weights.ties import TIED, Names, names_by_param, tie_map

__all__ = ["only_local", "pipelined_model", "plan_staged"]


def _pipelined(module: nn.Module) -> bool:
    from accel.parallel.pipeline.stages import pipeline_of

    return pipeline_of(module) is not None


def pipelined_model(obj: Any, objects: Mapping[str, Any]) -> nn.Module | None:
    """The pipelined model ``obj`` is (or, for an optimizer, whose parameters it holds).

    Example:
        >>> pipelined_model(optimizer, {"model": model, "optimizer": optimizer}) is model
        True
    """
    if isinstance(obj, nn.Module):
        module = unwrap_model(obj)
        return module if _pipelined(module) else None
    groups = getattr(inner_optimizer(obj), "param_groups", None)
    if not isinstance(groups, list):
        return None
    wanted = {id(p) for g in groups for p in g.get("params", [])}
    for other in objects.values():
        if isinstance(other, nn.Module):
            module = unwrap_model(other)
            if _pipelined(module) and wanted <= {id(p) for p in module.parameters()}:
                return module
    return None


def _named_optimizer_state(optimizer: Any, model: nn.Module, tied: Mapping[str, str]
                           ) -> dict[str, Any]:
    """The optimizer's state keyed by its parameters' (global) names; a copy of a parameter
    tied across stages that another rank owns is left out (the owner's state is the same)."""
    inner = inner_optimizer(optimizer)
    saved = inner.state_dict()
    first = names_by_param(model)
    names = [[first[id(p)][0] for p in group["params"]] for group in inner.param_groups]
    positions = [p for group in saved["param_groups"] for p in group["params"]]
    flat = [n for group in names for n in group]
    by_position = dict(zip(positions, flat, strict=True))
    return {
        "state": {by_position[k]: v for k, v in saved["state"].items()
                  if by_position[k] not in tied},
        "param_groups": [{**g, "params": [p for p in n if p not in tied]} for g, n in
                         zip(saved["param_groups"], names, strict=True)],
    }


def _first_of_stage() -> bool:
    """Whether this rank is its stage's first (coordinate 0 on every dim but ``pp``)."""
    mesh = state().mesh
    coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate() or (), strict=False))
    return all(c == 0 for name, c in coordinate.items() if name != "pp")


def _refs(value: Any, path: str, plain: dict[str, torch.Tensor], cls: type | None,
          dtensors: dict[str, Any]) -> Any:
    """``value`` with every tensor replaced by a piece reference (keys are unique paths)."""
    if isinstance(value, torch.Tensor):
        key = path.lstrip(".") or "value"
        if cls is not None and isinstance(value, cls):
            dtensors[key] = value
        else:
            plain[key] = value.detach()
        return {SHARD_REF: key}
    if isinstance(value, Mapping):
        return {k: _refs(v, f"{path}.{k}", plain, cls, dtensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_refs(v, f"{path}.{i}", plain, cls, dtensors)
                           for i, v in enumerate(value))
    return value


def _merge(parts: list[Any]) -> Any:
    """The union of the stages' structures (models: keys; optimizers: state and groups)."""
    if all(isinstance(p, Mapping) and "param_groups" in p for p in parts):
        groups: list[dict[str, Any]] = []
        for part in parts:
            for number, group in enumerate(part["param_groups"]):
                if number == len(groups):
                    groups.append({**group, "params": []})
                groups[number]["params"] += [
                    n for n in group["params"] if n not in groups[number]["params"]]
        merged_state: dict[str, Any] = {}
        for part in parts:
            merged_state.update(part["state"])
        return {"state": merged_state, "param_groups": groups}
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)
    return out


def plan_staged(
    tmp: Path, name: str, obj: Any, objects: Mapping[str, Any], rank: int, writer: bool,
    accumulation_step: int | None,
) -> list[PlannedFile] | None:
    """The files of a pipelined model or its optimizer, else ``None`` (not pipelined).

    Every rank must call it for every object, in the same order (it gathers the stages'
    structures).

    Raises:
        CheckpointError: a pipelined model saved in the middle of an accumulation cycle.
    """
    model = pipelined_model(obj, objects)
    if model is None:
        return None
    if isinstance(obj, nn.Module) and accumulation_step:
        raise CheckpointError(
            f"save_state({name}=...) was called in the middle of a gradient accumulation "
            f"cycle (step {accumulation_step}) on a pipelined model, whose unsynced "
            "gradients live in its stages. Save on a sync step: "
            "`if accel.sync_gradients(): accel.save_state(...)`."
        )
    tied = tie_map(model)  # a tied parameter: once, under its first name (its owner's)
    if isinstance(obj, nn.Module):
        current: Any = {k: v for k, v in model.state_dict().items() if k not in tied}
        extra: dict[str, Any] = {"accumulation_step": accumulation_step, "pipelined": True,
                                 **_layout(model)}
    else:
        current = _named_optimizer_state(obj, model, tied)
        extra = {"fqn_keys": True, "pipelined": True}
    if tied:
        extra[TIED] = tied
    cls = dtensor_type()
    plain: dict[str, torch.Tensor] = {}
    dtensors: dict[str, Any] = {}
    skeleton = _refs(current, "", plain, cls, dtensors)
    meta = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for k, t in (*plain.items(), *dtensors.items())}
    from accel.comm.collectives import gather_object

    everyone = gather_object((skeleton, meta))
    files: list[PlannedFile] = []
    if writer:
        extra["sharded"] = {k: v for _, part in everyone for k, v in part.items()}
        files += plan_object(tmp, name, _merge([s for s, _ in everyone]), extra)
    pieces, where = _local_pieces(dtensors)
    if _first_of_stage():
        for key, tensor in plain.items():
            pieces[key] = tensor
            where[key] = {"offset": [0] * tensor.dim(), "shape": list(tensor.shape)}
    files += plan_object(tmp, f"{name}{SHARDS}_rank{rank}", pieces, {"pieces": where})
    return files


def _layout(model: nn.Module) -> dict[str, Any]:
    """What ``accel checkpoint inspect`` shows of the layout that saved ``model`` (loading
    ignores it): the mesh (``{"dims", "shape"}``, as FSDP's pieces record it) and the
    pipeline (``{"schedule", "stages": [units of each stage], "ranks": [stages of each
    pipeline rank]}``)."""
    from accel.parallel.pipeline.stages import pipeline_of

    st = state()
    pipe = pipeline_of(model)
    out: dict[str, Any] = {}
    if st.mesh is not None and st.mesh_shape is not None:
        out["mesh"] = {"dims": list(st.mesh.mesh_dim_names or ()), "shape": list(st.mesh_shape)}
    if pipe is not None:
        out["pipeline"] = {"schedule": pipe.spec.name,
                           "stages": [list(units) for units in pipe.stage_units],
                           "ranks": [list(stages) for stages in pipe.rank_stages]}
    return out


def only_local(saved: Any, module: nn.Module, optimizer: bool) -> Any:
    """``saved`` (a whole model's state, keyed by names) cut to what a pipelined ``module``'s
    stages hold on this rank; anything else is returned as it is.

    Example:
        >>> sorted(only_local({"inp.weight": w, "head.weight": h}, stage1_model, False))
        ['head.weight']
    """
    if not isinstance(saved, Mapping) or not _pipelined(module):
        return saved
    if not optimizer:
        own = set(module.state_dict())
        return {k: v for k, v in saved.items() if k in own}
    groups, entries = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(entries, Mapping):
        return saved
    names = Names(tie_map(module))  # a tied parameter: saved under its first name only
    own = {names.group(name) for name, _ in module.named_parameters()}
    return {
        **saved,
        "state": {k: v for k, v in entries.items() if names.group(k) in own},
        "param_groups": [{**g, "params": [p for p in g.get("params", [])
                                          if names.group(p) in own]}
                         if isinstance(g, Mapping) else g for g in groups],
    }

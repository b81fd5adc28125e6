"""Saving FSDP (DTensor) state in ``save_state``: each rank writes only its own shards.

An object whose state holds DTensors (a model sharded with FSDP2's ``fully_shard``, an optimizer
over its parameters) is stored as:

* ``NAME.json`` / ``NAME.safetensors`` (the writer, as for any object): the state dict with each
  DTensor replaced by a reference ``{"__accel_shard__": key}``; ``extra["sharded"]`` gives each
  key's global shape and dtype. Tensors that are not DTensors (buffers, optimizer steps) are
  stored there in full.
* ``NAME__shards_rankR.json`` / ``.safetensors`` (every rank ``R``): the rank's local pieces
  (``DTensor.to_local()``) under their keys; ``extra["pieces"]`` gives each piece's offset and
  shape in the global tensor.

An optimizer is saved through ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
so its state is keyed by parameter names (FQNs), not by positions (``extra["fqn_keys"]``).
Everything is safetensors and JSON; :mod:`accel.checkpoint.sharded.reshard` reads it back at any
world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel._files.objects import plan_object
from accel._files.writer import PlannedFile
from accel.core.mesh import covered_dims
from accel.core.state import state
from accel.core.tree import dtensor_type, holds_dtensors, plain_tensor
from accel.errors import AccelError, CheckpointArgumentError, CheckpointError
from accel.training.model import unwrap_model
from accel.weights.ties import TIED, owner, tie_map

__all__ = [
    "SHARDS",
    "SHARD_REF",
    "check_layout",
    "inner_optimizer",
    "owner_model",
    "plan_sharded",
]

SHARD_REF = "__accel_shard__"  # marks a DTensor's place in the writer's structure
SHARDS = "__shards"  # file suffix of a rank's pieces: NAME__shards_rankR


def inner_optimizer(obj: Any) -> Any:
    """The user's optimizer inside an ``accel`` prepared optimizer (else ``obj``)."""
    from accel.training.optim import PreparedOptimizer

    return obj.optimizer if isinstance(obj, PreparedOptimizer) else obj


def _optimizer_params(obj: Any) -> list[Any]:
    groups = getattr(obj, "param_groups", None)
    if not isinstance(groups, list):
        return []
    return [p for g in groups if isinstance(g, Mapping) for p in g.get("params", [])]


def owner_model(name: str, optimizer: Any, objects: Mapping[str, Any], op: str) -> nn.Module:
    """The model among ``objects`` that holds every parameter of ``optimizer``.

    Raises:
        CheckpointArgumentError: no model passed alongside holds them all.
    """
    wanted = {id(p) for p in _optimizer_params(optimizer)}
    for obj in objects.values():
        if isinstance(obj, nn.Module):
            module = unwrap_model(obj)
            if wanted <= {id(p) for p in module.parameters()}:
                return module
    raise CheckpointArgumentError(
        f"accel.{op}({name}=...) is an optimizer over FSDP-sharded parameters, and no model "
        f"passed to {op} holds all of them (models passed: "
        f"{[n for n, o in objects.items() if isinstance(o, nn.Module)]}). Its state is keyed "
        f"by parameter names, so pass the model too: `accel.{op}(dir, model=model, "
        f"{name}={name})`."
    )


def check_layout(objects: Mapping[str, Any], each: bool, op: str) -> None:
    """Refuse ``on_each_node`` with FSDP objects (a machine's copy would lack other shards).

    Depends only on the arguments and the models' sharding, so every rank raises alike.
    """
    if not each:
        return
    sharded = [
        n for n, o in objects.items()
        if isinstance(o, nn.Module) and holds_dtensors(unwrap_model(o).parameters())
    ]
    if sharded:
        raise CheckpointArgumentError(
            f"accel.{op}(on_each_node=True) cannot hold the FSDP-sharded model(s) {sharded}: "
            "each rank writes only its own shards, and a machine's copy would lack the other "
            "machines' shards. Save to a filesystem every machine reaches, with "
            f"`accel.{op}(..., on_each_node=False)`."
        )


def _split(value: Any, cls: type, found: dict[str, Any], path: str = "") -> Any:
    """``value`` with each DTensor replaced by a reference; the DTensors go into ``found``."""
    if isinstance(value, cls):
        key = base = path.lstrip(".") or "value"
        while key in found:
            key = f"{base}#{len(found)}"
        found[key] = value
        return {SHARD_REF: key}
    if isinstance(value, Mapping):
        return {k: _split(v, cls, found, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_split(v, cls, found, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_split(v, cls, found, f"{path}.{i}") for i, v in enumerate(value))
    return value


def _holds(value: Any, cls: type) -> bool:
    """Whether the nested ``value`` holds an instance of ``cls`` (a DTensor)."""
    if isinstance(value, cls):
        return True
    if isinstance(value, Mapping):
        return any(_holds(v, cls) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds(v, cls) for v in value)
    return False


def _root_coordinate(root: Any) -> dict[str, int]:
    """This rank's coordinate on each named dim of the block's mesh (empty without one)."""
    if root is None:
        return {}
    return dict(zip(root.mesh_dim_names or (), root.get_coordinate() or (), strict=False))


def _first_copy(mesh: Any, where_in_root: dict[str, int]) -> bool:
    """Whether this rank holds the first copy of a tensor on ``mesh``, a submesh of the block's
    mesh: coordinate 0 on every dim of the block's mesh that ``mesh`` lacks (e.g. ``tp`` for a
    layer left whole under tensor parallelism, whose FSDP shards repeat on each TP rank; a
    flattened dim such as ``dp_shard_cp`` covers the dims it flattens)."""
    names = mesh.mesh_dim_names
    covered = {dim for name in names or () for dim in covered_dims(name)}
    if not names or not covered <= set(where_in_root):
        return True  # a mesh of the user's own: its pieces are all written
    # a pipeline stage's tensors live on its own "pp" coordinate only: each stage writes its own
    return all(c == 0 for name, c in where_in_root.items() if name not in covered and name != "pp")


def _local_pieces(
    dtensors: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, list[int]]]]:
    """This rank's pieces of each DTensor and where they lie in the global tensor.

    A piece replicated over a mesh dimension is written by the coordinate-0 rank of that
    dimension only, so every element is stored once.
    """
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pieces: dict[str, torch.Tensor] = {}
    where: dict[str, dict[str, list[int]]] = {}
    root = state().mesh
    where_in_root = _root_coordinate(root)
    for key, dt in dtensors.items():
        coordinate = dt.device_mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the tensor's mesh
            continue
        if where_in_root and not _first_copy(dt.device_mesh, where_in_root):
            continue  # the same piece lives on the ranks of the mesh dims this tensor lacks
        if any(isinstance(p, Partial) for p in dt.placements):
            raise CheckpointError(
                f"Cannot save {key!r}: it is a DTensor with a Partial placement "
                f"({dt.placements!r}), whose local values are not yet reduced. Save after "
                "the reduction (e.g. after the optimizer step)."
            )
        if any(isinstance(p, Replicate) and coordinate[i] != 0
               for i, p in enumerate(dt.placements)):
            continue
        shape, offset = compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh, dt.placements
        )
        local = plain_tensor(dt.to_local().detach())  # torchao's float8 weights: their values
        if tuple(local.shape) != tuple(shape):
            raise CheckpointError(
                f"Cannot save {key!r}: its local shard has shape {tuple(local.shape)}, not the "
                f"{tuple(shape)} its placements {dt.placements!r} give. Only evenly described "
                "Shard/Replicate placements (as fully_shard makes) can be saved."
            )
        pieces[key] = local
        where[key] = {"offset": [int(o) for o in offset], "shape": [int(s) for s in shape]}
    return pieces, where


def _state_of(name: str, obj: Any, model: nn.Module | None) -> Any:
    try:
        if model is None:
            return obj.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            model, inner_optimizer(obj), options=StateDictOptions(full_state_dict=False)
        )
    except AccelError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{name}.state_dict() raised {type(exc).__name__}: {exc}. Fix that object's "
            "`state_dict()`; nothing was saved."
        ) from exc


def plan_sharded(
    tmp: Path,
    name: str,
    obj: Any,
    objects: Mapping[str, Any],
    rank: int,
    writer: bool,
    accumulation_step: int | None,
) -> list[PlannedFile] | None:
    """The files of ``obj`` when its state holds DTensors, else ``None`` (save it as usual).

    Every rank plans its own pieces; the writer also plans the structure file.

    Raises:
        CheckpointError: a model saved in the middle of an accumulation cycle (its unsynced
            gradients live inside FSDP), or a DTensor that cannot be saved as pieces.
        CheckpointArgumentError: an FSDP optimizer passed without its model.
    """
    model: nn.Module | None = None
    if isinstance(obj, nn.Module):
        target: Any = unwrap_model(obj)
        if not holds_dtensors(target.parameters()):
            return None
        if accumulation_step:
            raise CheckpointError(
                f"save_state({name}=...) was called in the middle of a gradient accumulation "
                f"cycle (step {accumulation_step} of the cycle) on an FSDP-sharded model, "
                "whose unsynced gradients live inside FSDP and cannot be saved. Save on a "
                "sync step: `if accel.sync_gradients(): accel.save_state(...)`."
            )
        extra: dict[str, Any] = {"accumulation_step": accumulation_step}
        st = state()
        if st.mesh_shape is not None:  # for `accel checkpoint inspect`; loading ignores it
            extra["mesh"] = {"dims": list(st.mesh.mesh_dim_names or ()),
                             "shape": list(st.mesh_shape)}
    elif isinstance(getattr(inner_optimizer(obj), "param_groups", None), list):
        target = obj
        if not holds_dtensors(_optimizer_params(obj)):
            return None
        model = owner(obj, objects)  # none passed: its state is kept by positions
        extra = {"fqn_keys": True} if model is not None else {}
    else:  # any other object whose state holds DTensors (e.g. a LoRA adapter's weights)
        target = obj
        extra = {}
    cls = dtensor_type()
    if cls is None:  # no DTensor exists in this process
        return None
    state_dict = _state_of(name, target, model)
    if not isinstance(target, nn.Module) and model is None:
        if not _holds(state_dict, cls):
            return None  # saved as usual (its state_dict() is called again there)
    else:
        tied = tie_map(target if model is None else model)
        if model is None:  # a tied tensor is stored once, under its first name
            state_dict = {k: v for k, v in state_dict.items() if k not in tied}
        if tied:  # the optimizer's state is keyed by first names already (torch's FQNs)
            extra[TIED] = tied
    dtensors: dict[str, Any] = {}
    skeleton = _split(state_dict, cls, dtensors)
    files: list[PlannedFile] = []
    if writer:
        extra["sharded"] = {
            k: {"shape": list(d.shape), "dtype": str(d.dtype).removeprefix("torch.")}
            for k, d in dtensors.items()
        }
        files += plan_object(tmp, name, skeleton, extra)
    pieces, where = _local_pieces(dtensors)
    files += plan_object(tmp, f"{name}{SHARDS}_rank{rank}", pieces, {"pieces": where})
    return files

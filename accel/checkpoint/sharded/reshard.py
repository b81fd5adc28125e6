"""Loading FSDP (DTensor) state at any world size: each object's state in its target's form.

``load_state`` reads each object's structure file, then :func:`resolve` turns it into what the
target object takes, whatever the world size or strategy it was saved with:

* saved sharded (:mod:`accel.checkpoint.sharded.pieces`), target FSDP-sharded: each rank reads the
  pieces of the saved ranks' files that overlap its own shard and builds local DTensors with the
  target's mesh and placements;
* saved sharded, target plain (e.g. one process): the full tensors are assembled from every
  saved rank's pieces;
* saved in full (DDP, one process), target FSDP-sharded: each rank takes its slice.

Optimizer state saved keyed by parameter names becomes keyed by the target optimizer's own
positions (matched through the model's parameter names), so the ordinary
``optimizer.load_state_dict`` takes it; its per-parameter tensors get the sharding of their
parameter. Nothing is changed here: this runs in the verification step of ``load_state``.
"""

from __future__ import annotations

import bisect
import functools
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

import torch
from torch import nn

from accel._files.objects import read_checked, read_object
from accel._files.safe_io import load_json
from accel.checkpoint.sharded.pieces import (
    SHARD_REF,
    SHARDS,
    owner_model,
)
from accel.checkpoint.sharded.stages import only_local
from accel.core.tree import dtensor_type, holds_dtensors
from accel.errors import CheckpointError
from accel.training.model import unwrap_model
from accel.weights.ties import (
    PARAM_NAMES,
    by_names,
    match_names,
    names_by_param,
    owner,
    untie,
)

__all__ = ["Pieces", "are_counts", "disjoint", "resolve"]

_MAX_DIMS = 64  # as a safetensors header: more is no tensor accel wrote


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get(SHARD_REF), str)


class Pieces:
    """The pieces every saved rank wrote for one object, read on demand.

    Example:
        >>> pieces = Pieces(root, "model", manifest_files, structure["sharded"])
        >>> full = pieces.box("fc.weight", [0, 0], list(pieces.shape("fc.weight")), "cpu")
    """

    def __init__(self, path: Path, name: str, files: dict[str, Any], meta: Any) -> None:
        self.path, self.name, self.files = path, name, files
        if not isinstance(meta, Mapping):
            raise self._corrupt("its 'sharded' entry is not an object")
        self.meta: Mapping[str, Any] = meta
        prefix = f"{name}{SHARDS}_rank"
        self.where: dict[str, list[tuple[str, list[int], list[int]]]] = {}
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}
        for file in sorted(f for f in files if f.startswith(prefix) and f.endswith(".json")):
            stem = file.removesuffix(".json")
            raw = read_checked(path / file, files[file])
            body = load_json(raw, functools.partial(self._invalid, file))
            try:
                pieces = body["extra"]["pieces"]
            except (KeyError, TypeError) as exc:
                raise self._corrupt(f"{file} has no piece list ({exc!r})") from None
            if not isinstance(pieces, Mapping):
                raise self._corrupt(f"{file} has no piece list ({pieces!r:.60})")
            for key, spot in pieces.items():
                offset = spot.get("offset") if isinstance(spot, Mapping) else None
                size = spot.get("shape") if isinstance(spot, Mapping) else None
                if not (are_counts(offset) and are_counts(size) and len(offset) == len(size)):
                    raise self._corrupt(f"{file} places its piece of {key!r} at {spot!r:.80}")
                self.where.setdefault(key, []).append((stem, offset, size))

    def _invalid(self, file: str, problem: str) -> CheckpointError:
        return self._corrupt(f"{file} is not valid ({problem})")

    def _corrupt(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"The checkpoint at {os.fspath(self.path)!r} is corrupted: object {self.name!r}: "
            f"{what}. Load an earlier checkpoint."
        )

    def shape(self, key: str) -> tuple[int, ...]:
        entry = self.meta.get(key)
        if not isinstance(entry, Mapping) or not are_counts(entry.get("shape")):
            raise self._corrupt(f"no global shape for {key!r}")
        return tuple(entry["shape"])

    def _tensors(self, stem: str) -> dict[str, torch.Tensor]:
        if stem not in self.loaded:
            self.loaded[stem] = read_object(self.path, stem, self.files)[0]
        return self.loaded[stem]

    def box(self, key: str, offset: list[int], shape: list[int], device: Any) -> torch.Tensor:
        """The part ``[offset, offset + shape)`` of the global tensor ``key``.

        Every piece must lie inside the global tensor, the pieces overlapping the box must
        cover it exactly once (no gap, no value twice), and each must be in its file with its
        declared shape; all is checked before the box is allocated.
        """
        dtype = getattr(torch, str(self.meta[key].get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise self._corrupt(f"{key!r} has dtype {self.meta[key].get('dtype')!r}")
        whole = self.shape(key)
        found: list[tuple[torch.Tensor, list[int], list[int], list[int]]] = []
        for stem, start, size in self.where.get(key, []):
            if len(start) != len(whole) or any(
                a + n > g for a, n, g in zip(start, size, whole, strict=True)
            ):
                raise self._corrupt(
                    f"{stem}.json places a piece of {key!r} at {start} of shape {size}, outside "
                    f"its global shape {list(whole)}"
                )
            lo = [max(a, b) for a, b in zip(offset, start, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, start, size, strict=True)]
            if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
                continue
            held: Any = self._tensors(stem)
            piece = held.get(key) if isinstance(held, Mapping) else None
            if not isinstance(piece, torch.Tensor) or list(piece.shape) != list(size):
                raise self._corrupt(f"{stem}.safetensors lacks its piece of {key!r}")
            if piece.dtype != dtype:
                raise self._corrupt(
                    f"{stem}.safetensors holds its piece of {key!r} as {piece.dtype}, not the "
                    f"{dtype} the structure file records"
                )
            found.append((piece, start, lo, hi))
        needed = math.prod(shape)
        filled = sum(math.prod(b - a for a, b in zip(lo, hi, strict=True))
                     for _, _, lo, hi in found)
        if filled != needed:
            raise self._corrupt(
                f"its pieces of {key!r} cover {filled} of the {needed} values needed"
            )
        if not disjoint([(lo, hi) for _, _, lo, hi in found]):
            raise self._corrupt(
                f"its pieces of {key!r} overlap: they hold the {needed} values needed, but some "
                "twice and others not at all"
            )
        out = torch.empty(shape, dtype=dtype, device=device)
        for piece, start, lo, hi in found:
            src = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start, strict=True))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
            out[dst].copy_(piece[src])
        return out


def are_counts(value: Any) -> TypeGuard[list[int]]:
    """Whether ``value`` is a list of ints >= 0 (a shape or an offset, as accel writes them)."""
    return isinstance(value, list) and len(value) <= _MAX_DIMS and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def disjoint(boxes: list[tuple[list[int], list[int]]]) -> bool:
    """Whether no two boxes ``[lo, hi)`` share a point: each is marked on the grid their
    corners cut the space into (at most as many cells as the values they cover)."""
    if len(boxes) < 2:
        return True
    if not boxes[0][0]:
        return False  # two non-empty boxes of a scalar
    cuts = [sorted({b[0][d] for b in boxes} | {b[1][d] for b in boxes})
            for d in range(len(boxes[0][0]))]
    grid = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for lo, hi in boxes:
        cell = tuple(slice(bisect.bisect_left(c, a), bisect.bisect_left(c, b))
                     for c, a, b in zip(cuts, lo, hi, strict=True))
        if bool(grid[cell].any()):
            return False
        grid[cell] = True
    return True


def _local_box(like: Any) -> tuple[list[int], list[int]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        like.shape, like.device_mesh, like.placements
    )
    return [int(o) for o in offset], [int(s) for s in shape]


def _convert(value: Any, like: Any, pieces: Pieces | None, what: str) -> Any:
    """``value`` (a tensor in full or a piece reference) for a target shaped like ``like``.

    ``like`` is the target's DTensor (the result is a DTensor with its mesh and placements) or
    ``None`` (the result is the full tensor).
    """
    ref = _is_ref(value)
    if not ref and not isinstance(value, torch.Tensor):
        return value
    if ref:
        if pieces is None:
            raise CheckpointError(f"{what}: a shard reference outside a sharded object")
        key = value[SHARD_REF]
        shape = pieces.shape(key)
    else:
        shape = tuple(value.shape)
    if like is None:
        if not ref:
            return value
        return pieces.box(key, [0] * len(shape), list(shape), "cpu")  # type: ignore[union-attr]
    if tuple(like.shape) != shape:
        raise CheckpointError(
            f"{what} has shape {shape} in the checkpoint and {tuple(like.shape)} in the "
            "object passed: it was saved from another model. Load the matching checkpoint."
        )
    from torch.distributed.tensor import DTensor

    offset, size = _local_box(like)
    device = like.to_local().device
    if ref:
        local = pieces.box(key, offset, size, device)  # type: ignore[union-attr]
    else:
        part = tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))
        local = value[part].to(device=device, copy=True)
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
        stride=like.stride(),
    )


def _module_state(name: str, module: Any, saved: Any, pieces: Pieces | None) -> Any:
    """A module's (or any object's) saved state as its live ``state_dict()`` is shaped."""
    if not isinstance(saved, Mapping):
        return saved  # check_fits says what is wrong
    cls = dtensor_type()
    own = module.state_dict()
    out = {}
    for key, value in saved.items():
        target = own.get(key)
        if key not in own and _is_ref(value):
            out[key] = value  # an unexpected key: check_fits names it
            continue
        like = target if cls is not None and isinstance(target, cls) else None
        out[key] = _convert(value, like, pieces, f"The checkpoint's {name}[{key!r}]")
    return out


def _optimizer_state(
    name: str, optimizer: Any, saved: Any, extra: Mapping[str, Any], model: nn.Module | None,
    pieces: Pieces | None,
) -> Any:
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    state = saved.get("state") if isinstance(saved, Mapping) else None
    own_groups = optimizer.param_groups
    if not isinstance(groups, list) or not isinstance(state, Mapping) or (
        len(groups) != len(own_groups)
    ):
        return saved  # check_fits says what is wrong
    cls = dtensor_type()
    by_name = model is not None
    used: set[Any] = set()
    new_state: dict[Any, Any] = {}
    new_groups = []
    index = 0
    for number, (group, own) in enumerate(zip(groups, own_groups, strict=True)):
        saved_ids = list(group.get("params", [])) if isinstance(group, Mapping) else []
        params = own["params"]
        if model is not None:
            wanted = match_names(saved_ids, params, model, extra)
            if None in wanted or set(wanted) != set(map(str, saved_ids)):
                first = names_by_param(model)
                own_names = [first.get(id(p), ["?"])[0] for p in params]
                raise CheckpointError(
                    f"The checkpoint's optimizer {name!r} has parameters {saved_ids[:6]} in "
                    f"group {number}, the optimizer passed as {name}= has {own_names[:6]}. Create "
                    "the optimizer over the same parameters, in the same groups."
                )
            keys: list[Any] = wanted
        elif len(saved_ids) != len(params):
            return saved  # check_fits says what is wrong
        else:
            keys = saved_ids
        ids = []
        for key, param in zip(keys, params, strict=True):
            slot = index if by_name else key
            ids.append(slot)
            index += 1
            entry = state.get(key)
            if not isinstance(entry, Mapping):
                continue
            like = param if cls is not None and isinstance(param, cls) else None
            again = key in used  # one saved tensor for two untied parameters: copy it
            used.add(key)
            new_state[slot] = {
                k: _copy(_convert(v, like if _param_shaped(v, param, pieces) else None, pieces,
                                  f"The checkpoint's {name} state {k!r} of {key!r}"), again)
                for k, v in entry.items()
            }
        new_groups.append({**group, "params": ids})
    return {**saved, "state": new_state, "param_groups": new_groups}


def _copy(value: Any, again: bool) -> Any:
    return value.clone() if again and isinstance(value, torch.Tensor) else value


def _param_shaped(value: Any, param: Any, pieces: Pieces | None) -> bool:
    if _is_ref(value) and pieces is not None:
        return pieces.shape(value[SHARD_REF]) == tuple(param.shape)
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)


def _optimizer_params(obj: Any) -> list[Any]:
    groups = getattr(obj, "param_groups", None)
    if not isinstance(groups, list):
        return []
    return [p for g in groups if isinstance(g, Mapping) for p in g.get("params", [])]


def resolve(
    path: Path,
    files: dict[str, Any],
    objects: Mapping[str, Any],
    loaded: dict[str, tuple[Any, dict[str, Any]]],
) -> None:
    """Put each object's loaded state in the form its target takes (in place in ``loaded``).

    A plain checkpoint for plain objects is left as it is (no work).

    Raises:
        CheckpointError: missing or corrupted pieces, or a state that does not fit.
        CheckpointArgumentError: an optimizer saved by parameter names without its model.
    """
    for name, obj in objects.items():
        saved, extra = loaded[name]
        meta = extra.get("sharded")
        by_name = bool(extra.get("fqn_keys"))
        module = unwrap_model(obj) if isinstance(obj, nn.Module) else None
        if module is not None and isinstance(saved, Mapping):
            saved = untie(module, saved, extra)  # tied names: each as the target names it
            saved = only_local(saved, module, optimizer=False)  # a pipeline stage's names
        model: nn.Module | None = None
        if by_name:
            model = owner_model(name, obj, objects, "load_state")
        elif module is None and PARAM_NAMES in extra:  # positions + names: match by name
            model = owner(obj, objects)
            keyed = by_names(saved, extra) if model is not None else None
            if keyed is not None:
                saved, by_name = keyed, True
            else:
                model = None
        if by_name and model is not None:
            saved = only_local(saved, model, optimizer=True)
        params = module.parameters() if module is not None else _optimizer_params(obj)
        if meta is None and not by_name and not holds_dtensors(params):
            loaded[name] = (saved, extra)
            continue
        pieces = Pieces(path, name, files, meta) if meta is not None else None
        if module is not None:
            saved = _module_state(name, module, saved, pieces)
        elif isinstance(getattr(obj, "param_groups", None), list):
            saved = _optimizer_state(name, obj, saved, extra, model, pieces)
        elif pieces is not None:  # another object saved with DTensors: shaped like its own
            saved = _module_state(name, obj, saved, pieces)
        loaded[name] = (saved, extra)

"""DeepSpeed's partitioned checkpoint put back together per parameter: weights and optimizer state.

The optimizer states of each rank (read by :mod:`accel.checkpoint.foreign.deepspeed_files`) hold
flat 1-D slices; everything per parameter lies in them the same way:

* ZeRO 1/2: per group, the group's trainable parameters (``param_shapes``, in flattening
  order) one after another, each followed by its recorded alignment padding
  (``param_alignment_paddings``), cut into equal pieces, one per rank; the last rank's piece
  also ends in the group's padding (``group_paddings``), which the saved fp32 master weights
  leave out and the torch optimizer's state (``exp_avg``...) keeps;
* ZeRO-3: per sub-group, each parameter cut into ``ceil(n / ranks)`` pieces (the last one
  padded), rank ``r`` holding piece ``r`` of every parameter, one after another.

A parameter's fp32 master weight and each elementwise state of the torch optimizer that
stepped the flat slices (Adam's ``exp_avg``, ``exp_avg_sq``; any state as long as the slice)
are cut out of every rank's slices at the same place (:class:`_Place`). Scalar states (the
``step`` count) are given to every parameter of the slice. The optimizer's groups keep their
hyper-parameters (``lr``, ``betas``...) and list the parameters by position, with their names
alongside (:class:`OptimizerState`), the form accel's own checkpoints give to ``load_state``.
ZeRO stage 0 has no partitioned master weights: the module's weights are used, in their dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from accel._files.objects import Entry
from accel.checkpoint.foreign.deepspeed_files import (
    MODEL_FILE,
    OPTIM_FILE,
    ModelStates,
    OptimStates,
    bad,
    model_states,
    optim_states,
    rank_files,
    tag_dir,
)
from accel.errors import CheckpointError

__all__ = [
    "DeepSpeedTag", "DeepSpeedWeights", "OptimizerState", "open_deepspeed",
    "optimizer_state", "read_tag", "weights",
]

WEIGHTS_ONLY = "use `accel merge-weights DIR OUT` for its weights alone"


def _span(parts: Sequence[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """``length`` values from ``start`` of the 1-D tensors ``parts`` laid end to end."""
    pieces, at = [], 0
    for part in parts:
        size = part.numel()
        lo, hi = max(start, at), min(start + length, at + size)
        if lo < hi:
            pieces.append(part[lo - at : hi - at])
        at += size
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@attrs.frozen
class DeepSpeedWeights:
    """The weights of one tag: ``read(name)`` gives each full tensor."""

    tag: Path
    entries: list[Entry]
    read: Callable[[str], torch.Tensor]
    skipped: tuple[str, ...]


@attrs.frozen
class _Place:
    """Where one trainable parameter lies in every rank's flat slices."""

    flat: int  # the flat group (ZeRO-3: sub-group) holding it
    offset: int  # ZeRO-1/2: in the group's slices laid end to end; ZeRO-3: in each slice
    size: int  # ZeRO-1/2: its values; ZeRO-3: its piece on each rank
    shape: tuple[int, ...]


def _take(stage: int, place: _Place, per_rank: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The parameter at ``place`` in full, from each rank's flat tensors ``per_rank[r][flat]``."""
    if stage == 3:
        start, end = place.offset, place.offset + place.size
        whole = torch.cat([r[place.flat][start:end] for r in per_rank])
        return whole[: _numel(place.shape)].view(place.shape).clone()
    return _span([r[place.flat] for r in per_rank], place.offset, place.size).view(place.shape)


@attrs.frozen
class DeepSpeedTag:
    """One tag of a DeepSpeed checkpoint, read and checked; tensors are read on demand."""

    tag: Path
    stage: int
    world_size: int
    states: ModelStates
    optims: list[OptimStates]
    places: dict[str, _Place]  # trainable parameters held in the optimizer's flat slices
    flat_names: list[list[str]]  # per flat group: its parameters, in flattening order
    entries: list[Entry]
    readers: dict[str, Callable[[], torch.Tensor]]
    skipped: tuple[str, ...]
    master: bool  # trainable weights are the optimizer's fp32 master weights


def _zero12(states: ModelStates, optims: list[OptimStates], where: Path,
            places: dict[str, _Place]) -> None:
    flats = [o.flat for o in optims]
    if any(len(f) != len(states.groups) for f in flats):
        raise bad(where, f"its optimizer states hold {[len(f) for f in flats]} groups, the "
                  f"model states {len(states.groups)}")
    paddings = optims[0].paddings
    for index, shapes in enumerate(states.groups):
        total, offset = sum(f[index].numel() for f in flats), 0
        pads = paddings[index] if paddings is not None and index < len(paddings) else []
        if pads and len(pads) != len(shapes):
            raise bad(where, f"group {index} records {len(pads)} alignment paddings for "
                      f"{len(shapes)} parameters")
        for number, (name, shape) in enumerate(shapes.items()):
            size = _numel(shape)
            if offset + size > total:
                raise bad(where, f"parameter {name!r} {shape} lies past the {total} master "
                          f"weights of group {index}")
            places[name] = _Place(index, offset, size, shape)
            offset += size + (pads[number] if pads else 0)


def _zero3(states: ModelStates, optims: list[OptimStates], where: Path,
           places: dict[str, _Place]) -> None:
    ranks = len(optims)
    sizes = [[t.numel() for t in o.flat] for o in optims]
    if any(s != sizes[0] for s in sizes) or len(sizes[0]) != len(states.groups):
        raise bad(where, f"its ranks hold master-weight partitions of sizes {sizes} for "
                  f"{len(states.groups)} groups of parameters")
    for index, shapes in enumerate(states.groups):
        offset, held = 0, sizes[0][index]
        for name, shape in shapes.items():
            piece = -(-_numel(shape) // ranks)
            if offset + piece > held:
                raise bad(where, f"parameter {name!r} {shape} lies past the {held} master "
                          f"weights each rank holds of group {index}")
            places[name] = _Place(index, offset, piece, shape)
            offset += piece
        if offset != held:
            raise bad(where, f"the parameters of group {index} take {offset} of the {held} "
                      "master weights each rank holds")


def _frozen(all_states: list[ModelStates], stage: int, where: Path,
            readers: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for name, shape in all_states[0].frozen.items():
        pieces = [s.fragments.get(name) for s in (all_states if stage == 3 else all_states[:1])]
        found = [p for p in pieces if p is not None]
        if len(found) != len(pieces) or sum(p.numel() for p in found) < _numel(shape):
            raise bad(where, f"its frozen parameter {name!r} {shape} is not held in full")
        readers[name] = functools.partial(_frozen_read, found, shape)
        entries[name] = Entry(name, shape, found[0].dtype)
    return entries


def _frozen_read(pieces: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    return _span([p.reshape(-1) for p in pieces], 0, _numel(shape)).view(shape)


def _module_params(first: ModelStates, where: Path,
                   readers: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Entry]:
    """ZeRO-0: the trainable parameters as the module holds them."""
    params = {}
    for shapes in first.groups:
        for name, shape in shapes.items():
            if name not in first.module or tuple(first.module[name].shape) != shape:
                raise bad(where, f"its module holds no {name!r} of shape {shape}")
            readers[name] = functools.partial(first.module.__getitem__, name)
            params[name] = Entry(name, shape, first.module[name].dtype)
    return params


def read_tag(path: Path, wanted: str | None) -> DeepSpeedTag:
    """The tag ``wanted`` (default: the one ``latest`` names) of the DeepSpeed checkpoint at
    ``path`` (its root or one tag's directory), read and checked.

    Raises:
        CheckpointError: no such tag, a missing, corrupted or refused file (a global that is
            not DeepSpeed's), ranks' files that do not fit together, tensor- or
            pipeline-parallel saves.
        OSError: a file cannot be read.
    """
    tag = tag_dir(path, wanted)
    models, optim_files = rank_files(tag, MODEL_FILE), rank_files(tag, OPTIM_FILE)
    if not models:
        raise bad(tag, "it holds no *model_states.pt file")
    first = model_states(models[min(models)])
    optims = [optim_states(optim_files[r]) for r in sorted(optim_files)]
    stage = optims[0].stage if optims else 0
    world = optims[0].partitions if optims else (first.info["dp_world_size"] or 1)
    if optims and (sorted(optim_files) != list(range(world))
                   or any(o.stage != stage or o.partitions != world for o in optims)):
        raise bad(tag, f"it holds optimizer states of ranks {sorted(optim_files)}, for ZeRO "
                  f"stages {sorted({o.stage for o in optims})} over {world} ranks: one "
                  "rank's save is missing or from another run")
    all_states = [first]
    if stage == 3:
        if sorted(models) != list(range(world)):
            raise bad(tag, f"it holds ZeRO-3 model states of ranks {sorted(models)}, not of "
                      f"each of its {world} ranks")
        if first.frozen:
            all_states += [model_states(models[r]) for r in sorted(models)[1:]]
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    places: dict[str, _Place] = {}
    if stage in (1, 2, 3):
        (_zero3 if stage == 3 else _zero12)(first, optims, tag, places)
        flats = [o.flat for o in optims]
        params = {}
        for name, place in places.items():
            readers[name] = functools.partial(_take, stage, place, flats)
            params[name] = Entry(name, place.shape, flats[0][place.flat].dtype)
    else:  # ZeRO-0: no partitioned master weights; the module's own, in their dtype
        params = _module_params(first, tag, readers)
    params.update(_frozen(all_states, stage, tag, readers))
    entries: list[Entry] = []
    skipped: list[str] = []
    for key, tensor in first.module.items():
        if key in params:
            entries.append(params.pop(key))
        elif key in first.buffers:
            readers[key] = functools.partial(first.module.__getitem__, key)
            entries.append(Entry(key, tuple(tensor.shape), tensor.dtype))
        elif key not in first.shared:  # a tied name: written once, under the name it shares
            skipped.append(key)
    entries += params.values()  # parameters the module state does not list (none expected)
    flat_names = [list(g) for g in first.groups] if stage in (1, 2, 3) else []
    return DeepSpeedTag(tag, stage, world, first, optims, places, flat_names, entries, readers,
                        tuple(skipped), bool(optims))


def open_deepspeed(path: Path, wanted: str | None) -> DeepSpeedWeights:
    """The weights of the DeepSpeed checkpoint at ``path`` (its root or one tag's directory):
    the tag ``latest`` names, or ``wanted``.

    Raises:
        CheckpointError: no such tag, a missing, corrupted or refused file (a global that is
            not DeepSpeed's), tensor- or pipeline-parallel saves.
        OSError: a file cannot be read.
    """
    read = read_tag(path, wanted)
    return DeepSpeedWeights(read.tag, read.entries, lambda name: read.readers[name](),
                            read.skipped)


def weights(read: DeepSpeedTag) -> dict[str, torch.Tensor]:
    """Every tensor of the module's state in full (tied names once, under the name they
    share): the fp32 master weights of the trainable parameters, buffers as saved."""
    return {e.name: read.readers[e.name]() for e in read.entries}


@attrs.frozen
class OptimizerState:
    """The optimizer of a DeepSpeed checkpoint as one plain process's torch optimizer holds it.

    ``state_dict`` is keyed by position (``0, 1, ...`` over the groups in order); ``names``
    gives each group's parameter names in that order. ``hyper_saved`` is False when the
    files hold no hyper-parameters (ZeRO-1/2 ``elastic_checkpoint``): the groups then hold
    none.
    """

    state_dict: dict[str, Any]
    names: list[list[str]]
    hyper_saved: bool


def _not_understood(where: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"The optimizer state of the DeepSpeed checkpoint {str(where)!r} cannot be restored: "
        f"{what}. Leave the optimizer out of load_state (a fresh optimizer), or "
        f"{WEIGHTS_ONLY}; to resume with the optimizer, save with accel.save_state."
    )


@attrs.frozen
class _RankBase:
    """One rank's torch optimizer state over its flat slices."""

    groups: list[list[int]]  # per optimizer group, the flat groups it steps
    hyper: list[dict[str, Any]] | None
    states: list[Mapping[str, Any]]  # per flat group


def _rank_base(where: Path, optim: OptimStates) -> _RankBase:
    base, count = optim.base, len(optim.flat)
    if isinstance(base, Mapping) and isinstance(base.get("param_groups"), list) and isinstance(
            base.get("state"), Mapping):
        ids: list[Any] = []
        groups, hyper = [], []
        for group in base["param_groups"]:
            params = group.get("params") if isinstance(group, Mapping) else None
            if not isinstance(params, list):
                raise _not_understood(where, "its optimizer groups list no parameters")
            groups.append(list(range(len(ids), len(ids) + len(params))))
            ids += params
            hyper.append({str(k): v for k, v in group.items() if k != "params"})
        if len(ids) != count or len(set(map(repr, ids))) != count:
            raise _not_understood(where, f"its torch optimizer steps {len(ids)} tensors, not "
                                  f"the {count} flat master-weight groups of each rank")
        states = [base["state"].get(i) or {} for i in ids]
        return _RankBase(groups, hyper, [s if isinstance(s, Mapping) else {} for s in states])
    if isinstance(base, list | tuple) and len(base) == count and optim.stage in (1, 2) and all(
            isinstance(s, Mapping) for s in base):  # elastic_checkpoint: per group, unpadded
        return _RankBase([[i] for i in range(count)], None, list(base))
    raise _not_understood(where, "it holds no torch optimizer state DeepSpeed's ZeRO writes "
                          f"({type(base).__name__} under its base optimizer state)")


def _elementwise(where: Path, key: str, flat: int, rank: int, value: torch.Tensor,
                 length: int, padding: int) -> torch.Tensor:
    if value.numel() not in range(length, length + padding + 1) or not value.is_floating_point():
        raise _not_understood(
            where, f"rank {rank}'s state {key!r} of flat group {flat} holds {value.numel()} "
            f"{str(value.dtype).removeprefix('torch.')} values for {length} master weights: "
            "the optimizer keeps state that is not one value per weight (not Adam-like)")
    return value.reshape(-1)[:length]


def _as_step(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    return value.clone() if isinstance(value, torch.Tensor) else value


def optimizer_state(read: DeepSpeedTag) -> OptimizerState:
    """The optimizer's state per parameter, reassembled from every rank's flat slices.

    Raises:
        CheckpointError: ZeRO stage 0, no torch optimizer state, the ranks' states disagree,
            or a state that is not one value per master weight (not an Adam-like optimizer).
    """
    where = read.tag
    if read.stage not in (1, 2, 3):
        raise CheckpointError(
            f"The DeepSpeed checkpoint {str(where)!r} was saved without ZeRO (stage 0): its "
            "optimizer state is kept by position in the engine's own wrapper, which accel does "
            f"not read. Leave the optimizer out of load_state, or {WEIGHTS_ONLY}."
        )
    bases = [_rank_base(where, o) for o in read.optims]
    first = bases[0]
    if any(b.groups != first.groups or [sorted(s) for s in b.states]
           != [sorted(s) for s in first.states] for b in bases):
        raise _not_understood(where, "its ranks hold optimizer states of different layouts")
    per_key: dict[str, list[list[torch.Tensor]]] = {}
    scalars: list[dict[str, Any]] = []
    for state in first.states:
        own: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                per_key.setdefault(str(key), [[] for _ in bases])
            else:
                own[str(key)] = value
        scalars.append(own)
    empty = torch.empty(0)
    padded = read.stage in (1, 2) and first.hyper is not None  # elastic states are unpadded
    for key, ranks in per_key.items():
        for rank, (base, optim) in enumerate(zip(bases, read.optims, strict=True)):
            pads = optim.group_paddings if padded else None
            for flat, state in enumerate(base.states):
                value = state.get(key)
                if value is None:
                    ranks[rank].append(empty)
                    continue
                if not isinstance(value, torch.Tensor):
                    raise _not_understood(where, f"rank {rank}'s state {key!r} of flat group "
                                          f"{flat} is a {type(value).__name__}, not a tensor")
                padding = pads[flat] if pads is not None and flat < len(pads) else 0
                ranks[rank].append(_elementwise(where, key, flat, rank, value,
                                                optim.flat[flat].numel(), padding))
    state_dict: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    names: list[list[str]] = []
    step = read.optims[0].base_step
    for number, flats in enumerate(first.groups):
        hyper = dict(first.hyper[number]) if first.hyper is not None else {}
        ids: list[int] = []
        group_names: list[str] = []
        for flat in flats:
            for name in read.flat_names[flat]:
                index = sum(len(n) for n in names) + len(ids)
                ids.append(index)
                group_names.append(name)
                keys = [k for k in per_key if k in first.states[flat]]
                if not keys and not scalars[flat]:
                    continue  # the optimizer has not stepped: no state, as in torch
                place = read.places[name]
                entry = {k: _as_step(v) if k == "step" else _copy(v)
                         for k, v in scalars[flat].items()}
                for key in keys:
                    entry[key] = _take(read.stage, place, per_key[key])
                if "step" not in entry and ("step" in hyper or step is not None):
                    entry["step"] = _as_step(hyper.get("step", step))
                state_dict[index] = entry
        groups.append({**hyper, "params": ids})
        names.append(group_names)
    return OptimizerState({"state": state_dict, "param_groups": groups}, names,
                          first.hyper is not None)


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value

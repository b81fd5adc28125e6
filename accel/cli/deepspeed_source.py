"""Reading DeepSpeed's own checkpoint directories (``engine.save_checkpoint``), running no pickle.

DeepSpeed writes, under ``save_dir``::

    latest                                              # text: the tag of the newest save
    TAG/mp_rank_00_model_states.pt                      # ZeRO 0-2: the module state in full
    TAG/zero_pp_rank_R_mp_rank_00_model_states.pt       # ZeRO-3: one per rank (params empty)
    TAG/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt  # ZeRO 1-3: each rank's partition

The model states hold ``module`` (the state dict, in the engine's compute dtype; under ZeRO-3
each parameter is an empty placeholder), ``param_shapes`` (per optimizer group, the trainable
parameters in flattening order), ``buffer_names``, ``shared_params`` (tied names -> the name
they share) and the frozen parameters. The optimizer states hold each rank's slice of the fp32
master weights: ZeRO 1/2 ``single_partition_of_fp32_groups`` (per group, the group's
parameters flattened one after another, with the recorded alignment paddings, cut into equal
pieces, one per rank), ZeRO-3 ``fp32_flat_groups`` (each parameter cut into ``ceil(n / ranks)``
pieces, rank ``r`` holding piece ``r`` of every parameter, one after another).

:func:`open_deepspeed` gives the trainable parameters as those fp32 master weights (so a bf16
or fp16 run merges to fp32, as DeepSpeed's ``zero_to_fp32.py`` gives), buffers as the module
holds them, and tied names once (``from_pretrained`` ties them again). ZeRO stage 0 has no
partitioned master weights: the module's weights are used, in their dtype.

Every file is checked as accel's other torch readers check one
(:func:`accel._files.torch_zip.opened_torch_file`: zip structure, storage sizes, a pickle that
builds no more than the file holds). DeepSpeed's pickles name classes that
``torch.load(weights_only=True)`` refuses (``LossScaler``, ``ZeroStageEnum``,
``fragment_address``, ``argparse.Namespace``): each one the file names is allowed under that
name as an inert stand-in that only records its arguments, so no code of the checkpoint runs;
a file naming any other global (``os.system``, ``builtins.eval``...) is refused before it is
loaded. Tensors are memory-mapped: only the master weights are read.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from accel._files.safe_io import read_bounded
from accel._files.torch_pickle import InertObject, check_loaded, inert_globals
from accel._files.torch_zip import is_zip, opened_torch_file
from accel.errors import CheckpointError

__all__ = ["DeepSpeedWeights", "Entry", "describe_deepspeed", "is_deepspeed", "open_deepspeed"]

LATEST = "latest"
_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ALLOWED_PREFIXES = ("deepspeed.",)  # DeepSpeed's own classes: loss scaler, stage enum, ...
_ALLOWED = frozenset({"argparse.Namespace"})  # the launcher's args some engines save
_MAX_TAG = 255


def _owns_model_states(path: Path) -> bool:
    try:
        return any(_MODEL.match(name) for name in os.listdir(path))
    except OSError:
        return False


def is_deepspeed(path: Path) -> bool:
    """Whether ``path`` is a directory written by DeepSpeed's ``save_checkpoint``: its root
    (holding ``latest``) or one tag's directory (holding ``*model_states.pt``)."""
    if not path.is_dir():
        return False
    return (path / LATEST).is_file() or _owns_model_states(path)


def _bad(where: Path | str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{os.fspath(where)!r} is not a DeepSpeed checkpoint accel reads: {what}. Save it "
        "again with engine.save_checkpoint, or use accel.save_state."
    )


def _tag_dir(path: Path, wanted: str | None) -> Path:
    """The tag directory to read: ``path`` itself when it holds model states, else the tag
    ``wanted`` or the one ``latest`` names."""
    if _owns_model_states(path) and not (path / LATEST).is_file():
        if wanted not in (None, path.name):
            raise CheckpointError(
                f"{os.fspath(path)!r} is one DeepSpeed tag ({path.name!r}); --object "
                f"{wanted!r} names another. Give the directory holding it instead."
            )
        return path
    tags = sorted(n for n in os.listdir(path) if _owns_model_states(path / n))
    if wanted is None:
        try:
            raw = read_bounded(path / LATEST, 4096, follow_links=False)
        except OSError as exc:
            raise _bad(path, f"its {LATEST!r} file cannot be read ({exc})") from None
        wanted = raw.decode("utf-8", errors="replace").strip()
    if (not wanted or len(wanted) > _MAX_TAG or "/" in wanted or "\\" in wanted
            or wanted in (".", "..") or "\0" in wanted):
        raise _bad(path, f"the tag {wanted!r:.80} is not a directory name")
    target = path / wanted
    if target.is_symlink() or not target.is_dir() or not _owns_model_states(target):
        raise CheckpointError(
            f"The DeepSpeed checkpoint {os.fspath(path)!r} has no tag {wanted!r} holding model "
            f"states (its tags: {tags}). Pick one with --object TAG."
        )
    return target


def _allowed(name: str) -> bool:
    return name in _ALLOWED or name.startswith(_ALLOWED_PREFIXES)


def _load(file_path: Path) -> Any:
    """One DeepSpeed file, loaded weights-only with its DeepSpeed classes as inert stand-ins."""
    where = os.fspath(file_path)
    try:
        with opened_torch_file(file_path) as (file, own):  # zip and pickle checked first
            if not is_zip(file):
                raise _bad(where, "it is not in torch's zip format, which DeepSpeed writes")
            names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
            refused = [n for n in names if not _allowed(n)]
            if refused:
                raise CheckpointError(
                    f"{where!r} is refused: its pickle names {refused}, which no DeepSpeed "
                    "checkpoint holds (only DeepSpeed's own classes and argparse.Namespace are "
                    "read, as inert stand-ins). accel runs no code of a checkpoint; nothing of "
                    "it was loaded."
                )
            stand_ins = inert_globals(names)
            with torch.serialization.safe_globals(stand_ins):
                loaded = torch.load(own, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        reason = " ".join(str(exc).split()).split(" Check the doc")[0][-300:]
        raise CheckpointError(
            f"{where!r} was refused: torch.load(weights_only=True) cannot read it ({reason}). "
            "accel never unpickles checkpoint files."
        ) from None
    except OSError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"{where!r} is corrupted or unreadable ({type(exc).__name__}: {exc}). Copy or "
            "write the checkpoint again."
        ) from None
    check_loaded(loaded, lambda what: _bad(where, f"it {what}"))
    return loaded


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Size | tuple | list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        return tuple(value)
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, InertObject):  # ZeroStageEnum(2): an int enum, recorded by its argument
        args = value.__dict__.get("_args")
        value = args[0] if isinstance(args, tuple) and len(args) == 1 else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tensors(where: Path, key: str, value: Any) -> dict[str, torch.Tensor]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()
    ):
        raise _bad(where, f"its {key!r} is not a dict of tensors by name")
    return dict(value)


def _shapes(where: Path, key: str, value: Any) -> dict[str, tuple[int, ...]]:
    shapes = {k: _shape(v) for k, v in value.items()} if isinstance(value, Mapping) else None
    if shapes is None or not all(isinstance(k, str) for k in shapes):
        raise _bad(where, f"its {key!r} is not a dict of shapes by name")
    out = {k: v for k, v in shapes.items() if v is not None}
    if len(out) != len(shapes):
        raise _bad(where, f"its {key!r} holds a shape that is not a tuple of sizes")
    return out


@attrs.frozen
class Entry:
    """One tensor :func:`open_deepspeed` gives: its name, full shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@attrs.frozen
class DeepSpeedWeights:
    """The weights of one tag: ``read(name)`` gives each full tensor."""

    tag: Path
    entries: list[Entry]
    read: Callable[[str], torch.Tensor]
    skipped: tuple[str, ...]


@attrs.frozen
class _ModelStates:
    module: dict[str, torch.Tensor]
    buffers: list[str]
    groups: list[dict[str, tuple[int, ...]]]  # trainable parameters, per optimizer group
    frozen: dict[str, tuple[int, ...]]
    fragments: dict[str, torch.Tensor]
    shared: dict[str, str]
    info: dict[str, Any]


def _model_states(file_path: Path) -> _ModelStates:
    loaded = _load(file_path)
    if not isinstance(loaded, Mapping) or "module" not in loaded:
        raise _bad(file_path, "it holds no 'module' state")
    module = _tensors(file_path, "module", loaded["module"])
    buffers = loaded.get("buffer_names") or []
    groups = loaded.get("param_shapes")
    if groups is None:
        groups = [{k: tuple(v.shape) for k, v in module.items() if k not in buffers}]
    if not isinstance(buffers, list | tuple) or not all(isinstance(b, str) for b in buffers):
        raise _bad(file_path, "its 'buffer_names' is not a list of names")
    if isinstance(groups, Mapping):
        groups = [groups]
    if not isinstance(groups, list | tuple):
        raise _bad(file_path, "its 'param_shapes' is not a list of dicts of shapes")
    shared = loaded.get("shared_params") or {}
    if not isinstance(shared, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in shared.items()
    ):
        raise _bad(file_path, "its 'shared_params' is not a dict of names")
    config = loaded.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    stage = _int(zero.get("stage")) if isinstance(zero, Mapping) else None
    info = {
        "ds_version": loaded.get("ds_version") if isinstance(loaded.get("ds_version"), str)
        else None,
        "global_steps": _int(loaded.get("global_steps")),
        "dp_world_size": _int(loaded.get("dp_world_size")),
        "mp_world_size": _int(loaded.get("mp_world_size")),
        "config_stage": stage if stage is not None else 0,
    }
    return _ModelStates(
        module=module, buffers=list(buffers),
        groups=[_shapes(file_path, "param_shapes", g) for g in groups],
        frozen=_shapes(file_path, "frozen_param_shapes", loaded.get("frozen_param_shapes") or {}),
        fragments=_tensors(file_path, "frozen_param_fragments",
                           loaded.get("frozen_param_fragments") or {}),
        shared=dict(shared), info=info,
    )


@attrs.frozen
class _Optim:
    stage: int
    partitions: int
    flat: list[torch.Tensor]  # this rank's fp32 master-weight groups
    paddings: list[list[int]] | None


def _optim_states(file_path: Path) -> _Optim:
    loaded = _load(file_path)
    inner = loaded.get("optimizer_state_dict") if isinstance(loaded, Mapping) else None
    if not isinstance(inner, Mapping):
        raise _bad(file_path, "it holds no 'optimizer_state_dict'")
    stage = _int(inner.get("zero_stage"))
    count: Any = inner.get("partition_count")
    if isinstance(count, list | tuple):
        counts = {_int(c) for c in count}
        if len(counts) != 1:
            raise _bad(file_path, f"its groups are partitioned over {sorted(map(str, counts))} "
                       "ranks (expert parallelism), which accel does not merge")
        count = counts.pop()
    partitions = _int(count)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    flat = inner.get(key)
    if stage not in (1, 2, 3) or partitions is None or partitions < 1:
        raise _bad(file_path, f"it records ZeRO stage {stage!r} over {count!r:.40} ranks")
    if not isinstance(flat, list | tuple) or not all(
        isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype.is_floating_point for t in flat
    ):
        raise _bad(file_path, f"its {key!r} is not a list of flat floating tensors")
    paddings: Any = inner.get("param_alignment_paddings")
    if paddings is not None and not (isinstance(paddings, list | tuple) and all(
            isinstance(g, list | tuple) and all(_int(p) is not None and p >= 0 for p in g)
            for g in paddings)):
        raise _bad(file_path, "its 'param_alignment_paddings' is not lists of sizes")
    return _Optim(stage, partitions, list(flat),
                  None if paddings is None else [list(g) for g in paddings])


def _span(parts: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
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


def _files(tag: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for name in sorted(os.listdir(tag)):
        match = pattern.match(name)
        if match is None:
            continue
        if match.group(2) != "00":
            raise CheckpointError(
                f"The DeepSpeed checkpoint {os.fspath(tag)!r} holds {name}: a tensor- or "
                "pipeline-parallel save (model-parallel rank other than 00), which accel does "
                "not merge. Use DeepSpeed's own tools, or accel.save_state."
            )
        rank = int(match.group(1) or 0)
        if rank in found:
            raise _bad(tag, f"it holds two files for rank {rank} ({found[rank].name}, {name})")
        found[rank] = tag / name
    return found


@attrs.frozen
class _Read:
    tag: Path
    stage: int
    world_size: int
    states: _ModelStates
    entries: list[Entry]
    readers: dict[str, Callable[[], torch.Tensor]]
    skipped: tuple[str, ...]
    master: bool  # trainable weights are the optimizer's fp32 master weights


def _zero12(states: _ModelStates, optims: list[_Optim], where: Path,
            readers: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    flats = [o.flat for o in optims]
    if any(len(f) != len(states.groups) for f in flats):
        raise _bad(where, f"its optimizer states hold {[len(f) for f in flats]} groups, the "
                   f"model states {len(states.groups)}")
    paddings = optims[0].paddings
    for index, shapes in enumerate(states.groups):
        parts = [f[index] for f in flats]
        total, offset = sum(p.numel() for p in parts), 0
        pads = paddings[index] if paddings is not None and index < len(paddings) else []
        if pads and len(pads) != len(shapes):
            raise _bad(where, f"group {index} records {len(pads)} alignment paddings for "
                       f"{len(shapes)} parameters")
        for number, (name, shape) in enumerate(shapes.items()):
            size = _numel(shape)
            if offset + size > total:
                raise _bad(where, f"parameter {name!r} {shape} lies past the {total} master "
                           f"weights of group {index}")
            readers[name] = functools.partial(_zero12_read, parts, offset, size, shape)
            entries[name] = Entry(name, shape, parts[0].dtype)
            offset += size + (pads[number] if pads else 0)
    return entries


def _zero12_read(parts: list[torch.Tensor], offset: int, size: int,
                 shape: tuple[int, ...]) -> torch.Tensor:
    return _span(parts, offset, size).view(shape)


def _zero3(states: _ModelStates, optims: list[_Optim], where: Path,
           readers: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Entry]:
    ranks = len(optims)
    entries: dict[str, Entry] = {}
    offset = 0
    held = sum(t.numel() for t in optims[0].flat)
    if any(sum(t.numel() for t in o.flat) != held for o in optims):
        raise _bad(where, "its ranks hold master-weight partitions of different sizes")
    for shapes in states.groups:
        for name, shape in shapes.items():
            piece = -(-_numel(shape) // ranks)
            if offset + piece > held:
                raise _bad(where, f"parameter {name!r} {shape} lies past the {held} master "
                           "weights each rank holds")
            readers[name] = functools.partial(
                _zero3_read, [o.flat for o in optims], offset, piece, shape)
            entries[name] = Entry(name, shape, optims[0].flat[0].dtype)
            offset += piece
    if offset != held:
        raise _bad(where, f"its parameters take {offset} of the {held} master weights each "
                   "rank holds")
    return entries


def _zero3_read(flats: list[list[torch.Tensor]], offset: int, piece: int,
                shape: tuple[int, ...]) -> torch.Tensor:
    whole = torch.cat([_span(f, offset, piece) for f in flats])
    return whole[: _numel(shape)].view(shape).clone()


def _frozen(all_states: list[_ModelStates], stage: int, where: Path,
            readers: dict[str, Callable[[], torch.Tensor]]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for name, shape in all_states[0].frozen.items():
        pieces = [s.fragments.get(name) for s in (all_states if stage == 3 else all_states[:1])]
        found = [p for p in pieces if p is not None]
        if len(found) != len(pieces) or sum(p.numel() for p in found) < _numel(shape):
            raise _bad(where, f"its frozen parameter {name!r} {shape} is not held in full")
        readers[name] = functools.partial(_frozen_read, found, shape)
        entries[name] = Entry(name, shape, found[0].dtype)
    return entries


def _frozen_read(pieces: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    return _span([p.reshape(-1) for p in pieces], 0, _numel(shape)).view(shape)


def _read(path: Path, wanted: str | None) -> _Read:
    tag = _tag_dir(path, wanted)
    models, optim_files = _files(tag, _MODEL), _files(tag, _OPTIM)
    if not models:
        raise _bad(tag, "it holds no *model_states.pt file")
    first = _model_states(models[min(models)])
    optims = [_optim_states(optim_files[r]) for r in sorted(optim_files)]
    stage = optims[0].stage if optims else 0
    world = optims[0].partitions if optims else (first.info["dp_world_size"] or 1)
    if optims and (sorted(optim_files) != list(range(world))
                   or any(o.stage != stage or o.partitions != world for o in optims)):
        raise _bad(tag, f"it holds optimizer states of ranks {sorted(optim_files)}, for ZeRO "
                   f"stages {sorted({o.stage for o in optims})} over {world} ranks: one "
                   "rank's save is missing or from another run")
    all_states = [first]
    if stage == 3:
        if sorted(models) != list(range(world)):
            raise _bad(tag, f"it holds ZeRO-3 model states of ranks {sorted(models)}, not of "
                       f"each of its {world} ranks")
        if first.frozen:
            all_states += [_model_states(models[r]) for r in sorted(models)[1:]]
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    if stage in (1, 2):
        params = _zero12(first, optims, tag, readers)
    elif stage == 3:
        params = _zero3(first, optims, tag, readers)
    else:  # ZeRO-0: no partitioned master weights; the module's own, in their dtype
        params = {}
        for shapes in first.groups:
            for name, shape in shapes.items():
                if name not in first.module or tuple(first.module[name].shape) != shape:
                    raise _bad(tag, f"its module holds no {name!r} of shape {shape}")
                readers[name] = functools.partial(first.module.__getitem__, name)
                params[name] = Entry(name, shape, first.module[name].dtype)
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
    return _Read(tag, stage, world, first, entries, readers, tuple(skipped), bool(optims))


def open_deepspeed(path: Path, wanted: str | None) -> DeepSpeedWeights:
    """The weights of the DeepSpeed checkpoint at ``path`` (its root or one tag's directory):
    the tag ``latest`` names, or ``wanted``.

    Raises:
        CheckpointError: no such tag, a missing, corrupted or refused file (a global that is
            not DeepSpeed's), tensor- or pipeline-parallel saves.
        OSError: a file cannot be read.
    """
    read = _read(path, wanted)
    return DeepSpeedWeights(read.tag, read.entries, lambda name: read.readers[name](),
                            read.skipped)


def describe_deepspeed(path: Path, tensors: bool) -> dict[str, Any]:
    """The report ``accel checkpoint inspect`` prints for a DeepSpeed checkpoint directory."""
    problems: list[str] = []
    try:
        tag = _tag_dir(path, None)
    except CheckpointError as exc:
        return {"path": os.fspath(path), "format": "deepspeed", "tag": None, "zero_stage": None,
                "world_size": None, "objects": [], "files": [], "problems": [str(exc)]}
    files = []
    for name in sorted(os.listdir(tag)):
        file = tag / name
        status = "ok (structure; DeepSpeed writes no checksums)"
        try:
            if file.is_dir() or not name.endswith(".pt"):
                status = "not read"
            else:
                with opened_torch_file(file):
                    pass
        except (OSError, CheckpointError) as exc:
            status = f"invalid: {exc}"
            problems.append(f"{name}: {exc}")
        size = file.stat().st_size if file.is_file() else None
        files.append({"name": name, "size": size, "status": status})
    report: dict[str, Any] = {
        "path": os.fspath(path), "format": "deepspeed", "tag": tag.name, "zero_stage": None,
        "world_size": None, "ds_version": None, "step": None, "parameters": None,
        "weights": None, "objects": [], "files": files, "problems": problems,
    }
    try:
        read = _read(tag, None)
    except (OSError, CheckpointError) as exc:
        problems.append(str(exc))
        return report
    info = read.states.info
    count = sum(_numel(e.shape) for e in read.entries if e.name not in read.states.buffers)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in read.states.module.values()})
    report.update(
        zero_stage=read.stage, world_size=read.world_size, ds_version=info["ds_version"],
        step=info["global_steps"], parameters=count,
        weights=("fp32 master weights from the optimizer states" if read.master else
                 f"the module's weights ({', '.join(dtypes)})"),
    )
    item: dict[str, Any] = {
        "name": tag.name, "kind": "model",
        "layout": f"ZeRO-{read.stage} over {read.world_size} rank(s)",
        "bytes": sum(f["size"] or 0 for f in files),
    }
    if read.states.shared:
        item["tied"] = dict(read.states.shared)
    if tensors:
        item["tensors"] = [{"name": e.name, "shape": list(e.shape),
                            "dtype": str(e.dtype).removeprefix("torch.")} for e in read.entries]
    report["objects"] = [item]
    return report

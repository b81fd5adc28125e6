"""Reading one model's tensors out of a checkpoint, one at a time, for ``merge-weights``.

:func:`resolve_checkpoint` finds the checkpoint at a path (itself, or the newest complete
``checkpoint_N`` of a root; accel's own, one written by Accelerate's ``save_state``, or a
DeepSpeed ``save_checkpoint`` directory, read by :mod:`accel.checkpoint.foreign.deepspeed_params`).
:func:`open_model` gives one model of it as a :class:`ModelTensors`: every tensor's name,
shape and dtype, from the headers and metadata alone, and ``read(name)`` giving the full
tensor. For an FSDP-sharded accel checkpoint each tensor is assembled from every saved rank's
pieces (:class:`accel.checkpoint.sharded.reshard.Pieces`); otherwise it is a view of the
mapped file.
Every accel file is checked against the manifest (size, CRC32) before use; Accelerate's files
carry no checksums (their headers and zip structure are checked).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from accel._files.format import read_safetensors
from accel._files.objects import Entry, read_structure
from accel.checkpoint.layout import MANIFEST, candidates, is_complete, read_manifest
from accel.errors import CheckpointError

__all__ = ["Entry", "ModelTensors", "open_model", "resolve_checkpoint"]

_PREFIXES = ("module.", "_orig_mod.")


@attrs.frozen
class ModelTensors:
    """The tensors of one model in a checkpoint, read one at a time by ``read(name)``."""

    path: Path
    kind: str  # "accel", "accelerate" or "deepspeed"
    object_name: str
    entries: list[Entry]
    read: Callable[[str], torch.Tensor]
    verified: bool
    skipped: tuple[str, ...] = ()


def _not_a_checkpoint(path: Path) -> CheckpointError:
    from accel.checkpoint.foreign.accelerate import describe_found

    return CheckpointError(
        f"{os.fspath(path)!r} is not a checkpoint{describe_found(path)}. Give a directory "
        "written by accel.save_state (holding manifest.json), the root of its checkpoint_N "
        "directories, or a directory written by Accelerate's save_state."
    )


def resolve_checkpoint(path: Path) -> tuple[Path, str]:
    """The checkpoint to read at ``path`` and its kind (``"accel"``, ``"accelerate"`` or
    ``"deepspeed"``: a directory of DeepSpeed's ``save_checkpoint``, its root or one tag).

    ``path`` itself when it is one; for a root of ``checkpoint_N`` directories, the newest
    complete accel checkpoint (else the newest Accelerate or DeepSpeed one).

    Raises:
        CheckpointError: nothing there is a checkpoint (the message says what it holds).
    """
    from accel.checkpoint.foreign.accelerate import is_accelerate
    from accel.checkpoint.foreign.deepspeed_files import is_deepspeed

    if os.path.lexists(path / MANIFEST):
        return path, "accel"
    if is_deepspeed(path):  # also Accelerate's save_state under DeepSpeed (tag pytorch_model)
        return path, "deepspeed"
    if is_accelerate(path):
        return path, "accelerate"
    found, itself = candidates(path)
    if itself:  # save files without a manifest: a save that never completed
        raise CheckpointError(
            f"{os.fspath(path)!r} is an incomplete accel checkpoint (no {MANIFEST}): its save "
            "was killed before it completed. Use an earlier checkpoint."
        )
    for candidate in found:
        if is_complete(candidate):
            return candidate, "accel"
    for candidate in found:
        if is_deepspeed(candidate):
            return candidate, "deepspeed"
        if is_accelerate(candidate):
            return candidate, "accelerate"
    raise _not_a_checkpoint(path)


class _Refs(Mapping[str, Any]):
    """Stands for a tensor file while decoding a structure: each key gives a marker."""

    def __init__(self) -> None:
        self.used: list[str] = []

    def __getitem__(self, key: str) -> Any:
        self.used.append(key)
        return _Full(key)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str)

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0


@attrs.frozen
class _Full:
    key: str  # the tensor's key in NAME.safetensors


def _is_model(body: Mapping[str, Any]) -> bool:
    """A module's state: accel records its accumulation counter with it; else (an older
    checkpoint) a flat dict of tensors, as encoded: ``{"__tensor__": key}`` or a piece
    reference ``{"__dict__": [["__accel_shard__", key]]}``."""
    state, extra = body.get("state"), body.get("extra")
    if not isinstance(state, Mapping):
        return False
    if isinstance(extra, Mapping) and "accumulation_step" in extra:
        return True
    return bool(state) and all(
        isinstance(v, Mapping) and len(v) == 1 and ("__tensor__" in v or "__dict__" in v)
        for v in state.values()
    )


def _pick(path: Path, objects: list[str], bodies: Mapping[str, Mapping[str, Any]],
          wanted: str | None) -> str:
    models = [n for n in objects if _is_model(bodies[n])]
    if wanted is not None:
        if wanted not in objects:
            raise CheckpointError(
                f"The checkpoint at {os.fspath(path)!r} holds no object {wanted!r}; it holds "
                f"{objects}. Pass one of its models with --object (models: {models})."
            )
        if wanted not in models:
            raise CheckpointError(
                f"Object {wanted!r} of the checkpoint at {os.fspath(path)!r} is not a model "
                f"(an optimizer, scheduler or other state). Its models: {models}."
            )
        return wanted
    if "model" in models:
        return "model"
    if len(models) == 1:
        return models[0]
    if not models:
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} holds no model (objects: {objects}): "
            "there are no weights to merge."
        )
    raise CheckpointError(
        f"The checkpoint at {os.fspath(path)!r} holds several models {models}; choose one "
        f"with --object, e.g. `--object {models[0]}`."
    )


def _accel_source(path: Path, wanted: str | None) -> ModelTensors:
    from accel.checkpoint.sharded.pieces import SHARD_REF
    from accel.checkpoint.sharded.reshard import Pieces

    manifest = read_manifest(path)
    files = {f["name"]: f for f in manifest["files"]}
    objects = list(manifest["objects"])
    bodies = {n: read_structure(path, n, files) for n in objects if f"{n}.json" in files}
    missing = [n for n in objects if n not in bodies]
    if missing:
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} names objects {missing} whose structure "
            "files its manifest does not list: it is corrupted. Use an earlier checkpoint."
        )
    name = _pick(path, objects, bodies, wanted)
    body = bodies[name]
    from accel._files.encode import decode

    refs = _Refs()
    state = decode(body["state"], refs)  # markers stand for the tensors, read later
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"{os.fspath(path / f'{name}.json')!r} is corrupted: the state of model {name!r} "
            f"is a {type(state).__name__}, not a dict of tensors."
        )
    extra = body.get("extra") or {}
    full: dict[str, torch.Tensor] = {}
    headers: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if refs.used:
        meta = files.get(f"{name}.safetensors")
        tensor_path = path / f"{name}.safetensors"
        if meta is None or not os.path.lexists(tensor_path):
            raise CheckpointError(
                f"Checkpoint file {os.fspath(tensor_path)!r} is missing: the checkpoint is "
                "incomplete. Use an earlier checkpoint."
            )
        full, _ = read_safetensors(tensor_path, expected_crc32=meta["crc32"],
                                   expected_size=meta["size"], follow_links=False)
        from accel._files.values import check_recorded

        check_recorded(os.fspath(tensor_path), full, body.get("dtypes"))  # no relabelled header
        headers = {k: (tuple(t.shape), t.dtype) for k, t in full.items()}
    sharded = extra.get("sharded") if isinstance(extra, Mapping) else None
    pieces = Pieces(path, name, files, sharded) if sharded is not None else None
    entries: list[Entry] = []
    where: dict[str, Callable[[], torch.Tensor]] = {}
    skipped: list[str] = []
    for key, value in state.items():
        if isinstance(value, _Full):
            if value.key not in headers:
                raise CheckpointError(
                    f"{os.fspath(path / f'{name}.json')!r} names tensor {value.key!r}, which "
                    f"{name}.safetensors does not hold: the checkpoint is corrupted."
                )
            shape, dtype = headers[value.key]
            where[key] = functools.partial(full.__getitem__, value.key)
        elif isinstance(value, Mapping) and set(value) == {SHARD_REF} and pieces is not None:
            ref = value[SHARD_REF]
            shape = pieces.shape(ref)
            dtype = _dtype_of(path, name, ref, pieces.meta)
            where[key] = functools.partial(pieces.box, ref, [0] * len(shape), list(shape), "cpu")
        else:
            skipped.append(key)  # e.g. a module's `_extra_state`: not a weight
            continue
        entries.append(Entry(key, shape, dtype))
    return ModelTensors(path, "accel", name, entries, lambda k: where[k](), True, tuple(skipped))


def _dtype_of(path: Path, name: str, ref: str, meta: Mapping[str, Any]) -> torch.dtype:
    entry = meta.get(ref)
    text = entry.get("dtype") if isinstance(entry, Mapping) else None
    dtype = getattr(torch, text, None) if isinstance(text, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} is corrupted: object {name!r} gives "
            f"{ref!r} the dtype {text!r}. Use an earlier checkpoint."
        )
    return dtype


def _accelerate_source(path: Path, wanted: str | None) -> ModelTensors:
    from accel.weights.stream import read_weights

    name = wanted or "model"
    stem, _, number = name.partition("_")
    if stem != "model" or (number and not number.isdigit()):
        raise CheckpointError(
            f"--object {name!r}: an Accelerate checkpoint names its models model, model_1, "
            f"model_2, ... (it holds {sorted(os.listdir(path))[:12]})."
        )
    suffix = f"_{number}" if number else ""
    for file in (f"model{suffix}.safetensors", f"pytorch_model{suffix}.bin"):
        if (path / file).is_file():
            tensors = read_weights(path / file)
            break
    else:
        sharded = sorted(n for n in os.listdir(path) if n.startswith("pytorch_model_fsdp"))
        fix = (f" It holds {sharded}: an FSDP sharded state (torch.distributed.checkpoint), "
               "which accel does not read; merge it with `accelerate merge-weights`, or save "
               "with fsdp_state_dict_type FULL_STATE_DICT." if sharded else "")
        raise CheckpointError(
            f"The Accelerate checkpoint at {os.fspath(path)!r} has no model{suffix}.safetensors "
            f"or pytorch_model{suffix}.bin.{fix}"
        )
    for prefix in _PREFIXES:  # save_state of a DDP or compiled model keeps the wrapper's prefix
        if tensors and all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    entries = [Entry(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    return ModelTensors(path, "accelerate", name, entries, tensors.__getitem__, False)


def open_model(path: Path, kind: str, wanted: str | None) -> ModelTensors:
    """The tensors of model ``wanted`` (default: ``model``, or the only model) of the
    checkpoint at ``path`` of ``kind`` (from :func:`resolve_checkpoint`).

    Raises:
        CheckpointError: no such model, or a missing or corrupted file.
        OSError: a file cannot be read.
    """
    if kind == "deepspeed":
        from accel.checkpoint.foreign.deepspeed_params import open_deepspeed

        found = open_deepspeed(path, wanted)
        return ModelTensors(found.tag, "deepspeed", found.tag.name, found.entries, found.read,
                            False,
                            found.skipped)
    return (_accel_source if kind == "accel" else _accelerate_source)(path, wanted)

"""``accel merge-weights``: a training checkpoint to the weights layout ``save_model`` writes.

The input is a ``save_state`` checkpoint (FSDP-sharded at any world size, DDP, one process),
the root of numbered ones (its newest complete checkpoint is used), or a directory written by
Accelerate's ``save_state``. The output is what :func:`accel.save_model` writes and
``from_pretrained`` reads: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards
plus ``model.safetensors.index.json``.

One process does it, one tensor at a time: the shard plan comes from the checkpoint's headers
and metadata (names, shapes, dtypes), each shard's header is written first, then each tensor is
assembled (from every saved rank's pieces for FSDP), cast if asked, written and freed. Peak
memory is about one tensor (two when casting) besides the page cache of the mapped input
files. Every accel file read is checked against the manifest (size and CRC32) before use.
Tied tensors are written once, under the name the checkpoint stores them by (transformers'
``from_pretrained`` ties them again).

The output appears atomically: everything is written into a hidden sibling directory, fsynced
and renamed to ``OUT`` at the end; on any failure that directory is removed and nothing is
left.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from accel.checkpoint._atomic import temp_sibling
from accel.checkpoint._format import (
    _host,
    _view,
    fsync_dir,
    map_safetensors,
    read_safetensors,
    safetensors_prefix,
    write_bytes,
)
from accel.checkpoint._layout import MANIFEST, candidates, is_complete, read_manifest
from accel.checkpoint._objects import _read_checked
from accel.checkpoint._safe_io import MAX_JSON_BYTES, load_json, open_write, read_bounded
from accel.errors import CheckpointError

__all__ = ["MergeResult", "merge_weights", "resolve_checkpoint"]

_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"
_PREFIXES = ("module.", "_orig_mod.")


@attrs.frozen
class _Entry:
    """One tensor of the output: its name, shape and dtype as stored in the checkpoint."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@attrs.frozen
class _Source:
    """The tensors of one model in a checkpoint, read one at a time by ``read(name)``."""

    path: Path
    kind: str  # "accel" or "accelerate"
    object_name: str
    entries: list[_Entry]
    read: Callable[[str], torch.Tensor]
    verified: bool
    skipped: tuple[str, ...] = ()


@attrs.frozen
class MergeResult:
    """What :func:`merge_weights` wrote."""

    source: Path
    kind: str
    object_name: str
    out: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    verified: bool
    skipped: tuple[str, ...]


def _not_a_checkpoint(path: Path) -> CheckpointError:
    from accel.checkpoint._accelerate_format import describe_found

    return CheckpointError(
        f"{os.fspath(path)!r} is not a checkpoint{describe_found(path)}. Give a directory "
        "written by accel.save_state (holding manifest.json), the root of its checkpoint_N "
        "directories, or a directory written by Accelerate's save_state."
    )


def resolve_checkpoint(path: Path) -> tuple[Path, str]:
    """The checkpoint to read at ``path`` and its kind (``"accel"`` or ``"accelerate"``).

    ``path`` itself when it is one; for a root of ``checkpoint_N`` directories, the newest
    complete accel checkpoint (else the newest Accelerate one).

    Raises:
        CheckpointError: nothing there is a checkpoint (the message says what it holds).
    """
    from accel.checkpoint._accelerate_format import _is_accelerate

    if os.path.lexists(path / MANIFEST):
        return path, "accel"
    if _is_accelerate(path):
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
        if _is_accelerate(candidate):
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


def _structure(path: Path, name: str, files: Mapping[str, Any]) -> dict[str, Any]:
    meta = files.get(f"{name}.json")
    if meta is None:
        raise CheckpointError(f"The checkpoint at {os.fspath(path)!r} lists no {name}.json.")
    where = os.fspath(path / f"{name}.json")
    body = load_json(
        _read_checked(path / f"{name}.json", meta),
        lambda problem: CheckpointError(f"{where!r} is corrupted: {problem}."),
    )
    if not isinstance(body, dict) or "state" not in body:
        raise CheckpointError(f"{where!r} is corrupted: it holds no 'state'.")
    return body


def _is_model(body: Mapping[str, Any]) -> bool:
    extra = body.get("extra")
    return isinstance(extra, Mapping) and "accumulation_step" in extra and isinstance(
        body.get("state"), Mapping)


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


def _accel_source(path: Path, wanted: str | None) -> _Source:
    from accel.checkpoint._reshard import _Pieces
    from accel.checkpoint._sharded import SHARD_REF

    manifest = read_manifest(path)
    files = {f["name"]: f for f in manifest["files"]}
    objects = list(manifest["objects"])
    bodies = {n: _structure(path, n, files) for n in objects if f"{n}.json" in files}
    missing = [n for n in objects if n not in bodies]
    if missing:
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} names objects {missing} whose structure "
            "files its manifest does not list: it is corrupted. Use an earlier checkpoint."
        )
    name = _pick(path, objects, bodies, wanted)
    body = bodies[name]
    from accel.checkpoint._encode import decode

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
        headers = {k: (tuple(t.shape), t.dtype) for k, t in full.items()}
    sharded = extra.get("sharded") if isinstance(extra, Mapping) else None
    pieces = _Pieces(path, name, files, sharded) if sharded is not None else None
    entries: list[_Entry] = []
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
        entries.append(_Entry(key, shape, dtype))
    return _Source(path, "accel", name, entries, lambda k: where[k](), True, tuple(skipped))


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


def _accelerate_source(path: Path, wanted: str | None) -> _Source:
    from accel.checkpoint._stream import read_weights

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
    entries = [_Entry(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    return _Source(path, "accelerate", name, entries, tensors.__getitem__, False)


def _parse_size(value: int | str) -> int:
    from accel._sizes import parse_size

    size = parse_size(value)
    if size is None or size <= 0:
        raise CheckpointError(
            f"max_shard_size={value!r} is not a size; give bytes or a string such as '5GB', "
            "'500MB' or '2GiB'."
        )
    return size


def _cast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    from accel.tools.estimate import parse_dtype

    try:
        return parse_dtype(dtype)
    except Exception:
        raise CheckpointError(
            f"dtype {dtype!r} is not one merge-weights writes; give fp32, bf16 or fp16."
        ) from None


def _plan(entries: list[_Entry], cast: torch.dtype | None, limit: int) -> list[list[_Entry]]:
    """Shards in order, as save_model cuts them: a new one once the next tensor would pass."""
    shards: list[list[_Entry]] = [[]]
    used = 0
    for entry in entries:
        dtype = cast if cast is not None and entry.dtype.is_floating_point else entry.dtype
        nbytes = _numel(entry.shape) * dtype.itemsize
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(attrs.evolve(entry, dtype=dtype))
        used += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _write_shard(file: Path, shard: list[_Entry], source: _Source) -> int:
    """Write one safetensors shard tensor by tensor; returns its data bytes."""
    empty = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in shard}
    prefix, data_bytes = safetensors_prefix(empty, {"format": "pt"})
    with os.fdopen(open_write(file), "wb") as f:
        f.write(prefix)
        for entry in shard:
            tensor = source.read(entry.name)
            if tuple(tensor.shape) != entry.shape:
                raise CheckpointError(
                    f"The checkpoint at {os.fspath(source.path)!r} is corrupted: tensor "
                    f"{entry.name!r} has shape {tuple(tensor.shape)}, its header says "
                    f"{entry.shape}."
                )
            host = _host(tensor.to(entry.dtype))
            f.write(_view(host))
            del tensor, host
        f.flush()
        os.fsync(f.fileno())
    return data_bytes


def _config_bytes(config: str | os.PathLike[str]) -> bytes:
    path = Path(config).expanduser()
    if path.is_dir():
        path = path / "config.json"
    where = os.fspath(path)
    try:
        raw = read_bounded(path, MAX_JSON_BYTES, follow_links=True)
    except OSError as exc:
        raise CheckpointError(f"The model config {where!r} cannot be read ({exc}).") from None
    body = load_json(
        raw, lambda p: CheckpointError(f"The model config {where!r} is not valid: {p}.")
    )
    if not isinstance(body, dict):
        raise CheckpointError(f"The model config {where!r} is not a JSON object.")
    return raw


def _check_out(out: Path, source: Path) -> None:
    if os.path.lexists(out) and (out.is_symlink() or not out.is_dir() or any(os.scandir(out))):
        raise CheckpointError(
            f"The output {os.fspath(out)!r} already exists and is not an empty directory; "
            "merge-weights never replaces files. Give a new directory, or remove it first."
        )
    resolved, inside = out.resolve(), source.resolve()
    if resolved == inside or inside in resolved.parents:
        raise CheckpointError(
            f"The output {os.fspath(out)!r} is inside the checkpoint {os.fspath(source)!r}, "
            "which must hold only its own files. Write the weights elsewhere."
        )


def merge_weights(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    object_name: str | None = None,
    config: str | os.PathLike[str] | None = None,
) -> MergeResult:
    """Write the weights of a training checkpoint in the layout ``save_model`` writes.

    Args:
        checkpoint: a ``save_state`` checkpoint, the root of numbered ones (its newest
            complete one is used) or an Accelerate ``save_state`` directory.
        out: the new directory (it must not exist, or be empty).
        max_shard_size: the largest shard (``"5GB"``, ``"500MB"``, bytes).
        dtype: cast floating tensors to it (``"bf16"``, ``"fp16"``, ``"fp32"``).
        object_name: the model's name in the checkpoint (default ``"model"``, or its only
            model); ``model_1``... for a second model of an Accelerate checkpoint.
        config: a ``config.json`` (or a directory holding one) to copy into ``out``, so
            ``from_pretrained(out)`` can build the model.

    Returns:
        What was written.

    Raises:
        CheckpointError: no checkpoint at ``checkpoint``, no such model, a missing,
            truncated or corrupted file (size, CRC32, header), a bad size or dtype, an
            ``out`` that exists; nothing is written then.

    Example:
        >>> merge_weights("ckpt/checkpoint_500", "export", max_shard_size="2GB", dtype="bf16")
        MergeResult(source=PosixPath('ckpt/checkpoint_500'), kind='accel', ...)
    """
    limit = _parse_size(max_shard_size)
    cast = _cast_dtype(dtype)
    source_path, kind = resolve_checkpoint(Path(checkpoint))
    target = Path(out).expanduser()
    _check_out(target, source_path)
    config_raw = None if config is None else _config_bytes(config)
    read = _accel_source if kind == "accel" else _accelerate_source
    try:
        source = read(source_path, object_name)
    except OSError as exc:  # unreadable: permissions, I/O errors (refusals are CheckpointErrors)
        raise CheckpointError(f"Cannot read the checkpoint at {os.fspath(source_path)!r}: "
                              f"{exc}. Nothing was written.") from None
    shards = _plan(source.entries, cast, limit)
    names = ([_SAFE_WEIGHTS] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    target = Path(os.path.abspath(target))
    created = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(target)
    try:
        tmp.mkdir()
        total = sum(_write_shard(tmp / n, s, source) for n, s in zip(names, shards, strict=True))
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {e.name: n for n, s in zip(names, shards, strict=True) for e in s},
            }
            write_bytes(tmp / _SAFE_INDEX, json.dumps(index, indent=2, sort_keys=True).encode())
        if config_raw is not None:
            write_bytes(tmp / "config.json", config_raw)
        for name in names:  # each file as written is valid safetensors of the planned size
            map_safetensors(tmp / name, follow_links=False).mapped.close()
        fsync_dir(tmp)
        try:
            os.rename(tmp, target)  # an empty directory there is replaced, anything else fails
        except OSError as exc:
            raise CheckpointError(
                f"Cannot put the merged weights at {os.fspath(target)!r} ({exc}): something "
                "was created there meanwhile. Give a new directory."
            ) from None
        fsync_dir(target.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # parents made for this output, deepest first, if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        if isinstance(exc, OSError):  # a full disk, permissions, a file vanished meanwhile
            raise CheckpointError(
                f"merge-weights {os.fspath(source_path)!r} -> {os.fspath(target)!r} failed "
                f"({exc}); nothing was written."
            ) from exc
        raise
    files = (*names, *([_SAFE_INDEX] if len(shards) > 1 else []),
             *(["config.json"] if config_raw is not None else []))
    return MergeResult(
        source=source_path, kind=source.kind, object_name=source.object_name, out=target,
        files=files, tensors=len(source.entries), total_bytes=total,
        verified=source.verified, skipped=source.skipped,
    )

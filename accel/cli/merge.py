"""``accel merge-weights``: a training checkpoint to the weights layout ``save_model`` writes.

The input is a ``save_state`` checkpoint (FSDP-sharded at any world size, DDP, one process),
the root of numbered ones (its newest complete checkpoint is used), a directory written by
Accelerate's ``save_state``, or one written by DeepSpeed's ``engine.save_checkpoint`` (its fp32
master weights, read by :mod:`accel.checkpoint.foreign.deepspeed_params`, running no pickle).
The output is what :func:`accel.save_model` writes and ``from_pretrained`` reads:
``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards plus
``model.safetensors.index.json``.

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

import json
import os
import shutil
from pathlib import Path

import attrs
import torch

from accel._files.atomic import temp_sibling
from accel._files.format import (
    byte_view,
    fsync_dir,
    map_safetensors,
    on_host,
    safetensors_prefix,
    write_bytes,
)
from accel._files.safe_io import MAX_JSON_BYTES, load_json, open_write, read_bounded
from accel.cli.checkpoint_source import Entry, ModelTensors, open_model, resolve_checkpoint
from accel.core.sizes import parse_shard_size
from accel.errors import CheckpointError

__all__ = ["MergeResult", "merge_weights"]

_SAFE_WEIGHTS = "model.safetensors"
_SAFE_INDEX = "model.safetensors.index.json"


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


def _cast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    from accel.cli.estimate import parse_dtype

    try:
        return parse_dtype(dtype)
    except Exception:
        raise CheckpointError(
            f"dtype {dtype!r} is not one merge-weights writes; give fp32, bf16 or fp16."
        ) from None


def _plan(entries: list[Entry], cast: torch.dtype | None, limit: int) -> list[list[Entry]]:
    """Shards in order, as save_model cuts them: a new one once the next tensor would pass."""
    shards: list[list[Entry]] = [[]]
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


def _write_shard(file: Path, shard: list[Entry], source: ModelTensors) -> int:
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
            host = on_host(tensor.to(entry.dtype))
            f.write(byte_view(host))
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
            complete one is used), an Accelerate ``save_state`` directory or a DeepSpeed
            ``save_checkpoint`` directory (its root or one tag).
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
    limit = parse_shard_size(max_shard_size, example="5GB")
    cast = _cast_dtype(dtype)
    source_path, kind = resolve_checkpoint(Path(checkpoint))
    target = Path(out).expanduser()
    _check_out(target, source_path)
    config_raw = None if config is None else _config_bytes(config)
    try:
        source = open_model(source_path, kind, object_name)
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

"""Model weights: ``save``, ``save_model`` (HF layout), ``load_checkpoint_in_model``."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel._sizes import parse_size
from accel.checkpoint import _full_weights, _model_swap
from accel.checkpoint._atomic import leftovers, temp_sibling, write_file_atomically
from accel.checkpoint._format import write_bytes, write_safetensors
from accel.checkpoint._paths import as_module, as_path
from accel.checkpoint._safe_io import MAX_JSON_BYTES, load_json, read_bounded
from accel.checkpoint._ties import tie_map
from accel.errors import CheckpointError
from accel.model import unwrap_model

__all__ = ["get_state_dict", "load", "load_checkpoint_in_model", "save", "save_model"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


def get_state_dict(model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
    """The model's full state dict, with the unwrapped module's keys (no ``module.`` prefix).

    For an FSDP-sharded model every rank must call it: each tensor is gathered in turn, and
    every rank gets the full (unsharded) state dict on the CPU.

    Example:
        >>> sd = accel.get_state_dict(model)   # a DDP model gives the bare module's keys
    """
    target = unwrap_model(as_module(model, "accel.get_state_dict")) if unwrap else model
    sharded = _full_weights.sharded_state(target)
    if sharded is not None:
        return _full_weights.gather(sharded)
    return {k: v.detach() for k, v in target.state_dict().items()}


def _parse_size(size: int | str) -> int:
    parsed = parse_size(size)
    if parsed is None or parsed <= 0:
        raise CheckpointError(
            f"max_shard_size={size!r} is not a size; give bytes or a string such as '10GB', "
            "'500MB' or '2GiB'."
        )
    return parsed


def _shards(tensors: Mapping[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and used + nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += nbytes
    return shards


def _torch_save(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_shard(shard: dict[str, torch.Tensor], safe: bool, path: Path) -> None:
    if safe:
        write_safetensors(path, shard, metadata={"format": "pt"})
    else:
        _torch_save(path, {k: v.cpu() for k, v in shard.items()})


def _dedupe_shared(tensors: Mapping[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Keep every tensor, but warn once about tensors that share memory (tied weights)."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    shared = []
    for name, tensor in tensors.items():
        if tensor.numel() == 0 or tensor.device.type == "meta":
            continue
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
        )
        if key in seen:
            shared.append(f"{name} = {seen[key]}")
        else:
            seen[key] = name
    if shared:
        warnings.warn(
            f"{where}: tensors share memory ({', '.join(shared[:5])}); each is written in full, "
            "so loading restores them all (ties are kept by the module, not the file).",
            stacklevel=3,
        )
    return dict(tensors)


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    safe_serialization: bool | None = None,
    on_each_node: bool | None = None,
) -> None:
    """Save ``obj`` to one file, once (main process), atomically; the name picks the format.

    A ``.safetensors`` name (or ``safe_serialization=True``, whatever the name) writes
    safetensors, which holds a flat dict of ``str -> tensor`` (tensors sharing memory are each
    written in full, with a warning). Any other name (or ``safe_serialization=False``) writes
    torch's format, which plain ``torch.load(path)`` reads with its default
    ``weights_only=True``: the file is checked to load that way before it is put in place, and
    tied tensors stay shared. The file is written under a temporary name, fsynced and renamed
    into place, so a crash leaves the old file or the new one, never a partial file.

    Args:
        obj: A state dict, or (torch's format) tensors, numbers, strings and lists, tuples and
            dicts of them, such as ``{"model": ..., "optimizer": ..., "epoch": 3}``.
        path: The file to write; parent directories are created.
        safe_serialization: ``True``: safetensors; ``False``: torch's format; ``None`` (the
            default): safetensors for ``*.safetensors`` names, torch's format for others.
        on_each_node: Each machine's local main process writes its own copy (machines
            without a shared filesystem); default ``accel.state().on_each_node``. Otherwise
            only the main process writes.

    Raises:
        CheckpointError: safetensors asked for and ``obj`` is not a flat dict of tensors
            (names the key and type), or a torch-format ``obj`` that ``torch.load`` with
            ``weights_only=True`` could not read back (names the value). Nothing is written.
        CheckpointArgumentError: ``safe_serialization`` or ``on_each_node`` is not a bool.

    Example:
        >>> accel.save(accel.unwrap_model(model).state_dict(), "model.pt")  # torch.load reads it
        >>> accel.save(accel.get_state_dict(model), "model.safetensors")
    """
    from accel.checkpoint import _nodes, _single

    target = as_path(path, "accel.save")
    safe = _single.wants_safetensors(target, safe_serialization)
    each = _nodes.resolve(on_each_node, "save")
    tensors = _single.check_flat_tensors(obj, target) if safe else None
    if not _nodes.writes(each):
        return
    if tensors is not None:
        shared = _dedupe_shared(tensors, "accel.save")
        write_file_atomically(target, lambda tmp: _single.write_safetensors_file(tmp, shared))
    else:
        write_file_atomically(target, lambda tmp: _single.write_torch(tmp, obj, target))


def load(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> Any:
    """Read a file ``accel.save`` (or ``torch.save``, or safetensors) wrote; never runs code.

    The format is recognised from the content, not the name. A safetensors file gives a
    ``dict`` of tensors (in memory of their own, not views of the file). A torch file is read
    with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers of them
    load; a file that would build other objects or run code (a pickle with a malicious
    ``__reduce__``) is refused before anything in it runs. Every process may call it.

    Args:
        path: The file.
        map_location: Where the tensors go (``"cpu"``, ``"cuda:0"``, a ``torch.device``).

    Returns:
        What was saved.

    Raises:
        CheckpointError: no such file, a directory, a file in neither format, a truncated or
            corrupted file, or a torch file ``weights_only=True`` refuses; names the file.
        ConfigError: ``map_location`` is not a device.

    Example:
        >>> model.load_state_dict(accel.load("model.pt"))
    """
    from accel.checkpoint import _single

    return _single.read_file(as_path(path, "accel.load"), map_location)


def save_model(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    on_each_node: bool | None = None,
) -> Path:
    """Write the model's weights in the layout transformers and Accelerate load.

    ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` (``pytorch_model*.bin`` with ``safe_serialization=False``).
    Keys are the unwrapped module's. Every rank must call it (an FSDP model's weights are
    gathered one shard file at a time, so no rank holds more than one file's worth of full
    tensors); only the main process writes, or with ``on_each_node=True`` (default
    ``accel.state().on_each_node``) each machine's local main process writes its own copy,
    for machines without a shared filesystem.

    The weight set is replaced as a whole: the new files are written into a hidden sibling
    directory, the other entries of ``directory`` (``config.json``, tokenizer files,
    subdirectories such as ``checkpoint_5/``) are carried over, and the two directories swap
    names in one step. A save killed at any point leaves the old or the new weights, never a
    mix; the next ``save_model`` finishes or undoes its work. Weight files of an earlier save
    that are not part of the new set are not carried over.

    Raises:
        CheckpointError: ``max_shard_size`` is not a size, ``directory`` is a file or a mount
            point, or another process is saving to it.
        CheckpointArgumentError: ``on_each_node`` is not a bool.

    Example:
        >>> accel.save_model(model, "out", max_shard_size="200MB")
        PosixPath('out')
    """
    from accel.checkpoint import _nodes

    out = as_path(directory, "accel.save_model", "directory")
    as_module(model, "accel.save_model")
    limit = _parse_size(max_shard_size)
    each = _nodes.resolve(on_each_node, "save_model")
    module = unwrap_model(model)
    sharded = _full_weights.sharded_state(module)  # FSDP: gathered file by file
    tensors = get_state_dict(model) if sharded is None else sharded
    tied = tie_map(module)  # a tied weight is written once, under its first name
    if tied:
        tensors = {k: v for k, v in tensors.items() if k not in tied}
        sharded = None if sharded is None else tensors
    if not _nodes.writes(each):
        if sharded is not None:  # every rank takes part in each file's gathers, in order
            for shard in _shards(sharded, limit):
                _full_weights.gather(shard)
        return out
    if sharded is None:
        tensors = _dedupe_shared(tensors, "accel.save_model")
    shards = _shards(tensors, limit)
    weights, index_name = (SAFE_WEIGHTS, SAFE_INDEX) if safe_serialization else (
        TORCH_WEIGHTS, TORCH_INDEX)
    stem, ext = weights.rsplit(".", 1)
    names = (
        [weights]
        if len(shards) == 1
        else [f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}" for i in range(1, len(shards) + 1)]
    )
    target = _swap_target(out)
    _model_swap.check_target(target, names)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _model_swap.locked(target):
        _model_swap.recover(target, _is_complete)  # finish a save that was killed
        _model_swap.check_target(target, names)
        new = temp_sibling(target)
        new.mkdir()
        try:
            for name, shard in zip(names, shards, strict=True):
                full = shard if sharded is None else _full_weights.gather(shard)
                _write_shard(full, safe_serialization, new / name)
                del full
            if len(shards) > 1:
                index = {
                    "metadata": {
                        "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
                    },
                    "weight_map": {
                        k: n for n, shard in zip(names, shards, strict=True) for k in shard
                    },
                }
                write_bytes(new / index_name, json.dumps(index, indent=2, sort_keys=True).encode())
            if target.is_dir():
                _model_swap.carry(target, new)
        except BaseException:
            _model_swap.discard(new, target)  # nothing is in place yet
            raise
        _model_swap.install(new, target)
    return out


def _swap_target(out: Path) -> Path:
    """The directory entry to replace: absolute, and a symlink's target, not the link."""
    target = Path(os.path.abspath(out))
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    if not target.name:
        raise CheckpointError(
            f"save_model cannot write into {os.fspath(out)!r}: the new weights are built "
            "beside the directory and swapped in. Give a directory below the filesystem root."
        )
    return target


def _plain_file_name(value: object) -> bool:
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in ("/", "\\", "\0"))
        and not os.path.isabs(value)
        and not os.path.splitdrive(value)[0]
    )


def _index_files(index_path: Path) -> list[Path]:
    """The files an index names, each checked to be a plain file name beside the index."""
    where = os.fspath(index_path)
    fix = "Fix the file or write it again with accel.save_model."
    try:  # a link is followed (the Hugging Face cache links files to blobs), a FIFO is not
        raw = read_bounded(index_path, MAX_JSON_BYTES, follow_links=True)
    except OSError as exc:
        raise CheckpointError(f"Index {where!r} cannot be read ({exc}). {fix}") from None
    index = load_json(
        raw, lambda problem: CheckpointError(f"Index {where!r} is not valid: {problem}. {fix}")
    )
    if not isinstance(index, dict):
        problem = f"is a JSON {type(index).__name__}, not an object"
    elif "weight_map" not in index:
        problem = "has no 'weight_map'"
    elif not isinstance(index["weight_map"], dict):
        problem = f"has a 'weight_map' of type {type(index['weight_map']).__name__}"
    else:
        problem = ""
    if problem:
        raise CheckpointError(
            f"Index {where!r} {problem}; an index is "
            '{"metadata": {...}, "weight_map": {"<tensor name>": "<file name>", ...}}. ' + fix
        )
    weight_map: dict[str, object] = index["weight_map"]
    for key, value in weight_map.items():
        if not _plain_file_name(value):
            raise CheckpointError(
                f"Index {where!r} maps {key!r} to {value!r}, which is not a file name in the "
                "index's directory: weight_map values must be plain file names such as "
                "'model-00001-of-00002.safetensors' (no '/', '\\', '..' or absolute path). "
                + fix
            )
    return [index_path.parent / str(f) for f in dict.fromkeys(weight_map.values())]


def _is_complete(directory: Path) -> bool:
    """Whether ``directory`` holds a whole weight set (every file its index names)."""
    try:
        return all(f.is_file() for f in _checkpoint_files(directory))
    except (CheckpointError, OSError):
        return False


def _resolve(checkpoint: Path) -> Path:
    """``checkpoint``, or where its weights wait while a killed ``save_model`` left it missing.

    That happens only on platforms without an atomic directory swap, killed between the two
    renames: the old directory is put back if this process can take the writer lock, else it
    is read where it is.
    """
    if os.path.lexists(checkpoint) or not checkpoint.name or not leftovers(checkpoint, "old"):
        return checkpoint
    try:
        with _model_swap.locked(checkpoint):
            _model_swap.restore(checkpoint, _is_complete)
    except (CheckpointError, OSError):
        pass  # a writer is at work, or this place is read-only
    return _model_swap.old_copy(checkpoint, _is_complete) or checkpoint


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    if checkpoint.is_file() and checkpoint.name.endswith(".index.json"):
        return _index_files(checkpoint)
    if checkpoint.is_file():
        return [checkpoint]
    if checkpoint.is_dir():
        for index_name in (SAFE_INDEX, TORCH_INDEX):
            if (checkpoint / index_name).is_file():
                return _checkpoint_files(checkpoint / index_name)
        for single in (SAFE_WEIGHTS, TORCH_WEIGHTS):
            if (checkpoint / single).is_file():
                return [checkpoint / single]
        indexes = sorted(p for p in checkpoint.glob("*.index.json") if p.is_file())
        if len(indexes) == 1:  # another library's name for the index, as Accelerate reads
            return _index_files(indexes[0])
        if len(indexes) > 1:
            raise CheckpointError(
                f"{os.fspath(checkpoint)!r} holds several indexes "
                f"{[p.name for p in indexes]!r}; pass the one to load."
            )
    raise CheckpointError(
        f"No weights at {os.fspath(checkpoint)!r}: expected a .safetensors/.bin file, an "
        f"index.json, or a directory holding {SAFE_WEIGHTS}, {SAFE_INDEX}, {TORCH_WEIGHTS} or "
        f"{TORCH_INDEX}."
    )


def _read_into(
    target: nn.Module,
    files: list[Path],
    *,
    device_map: Mapping[str, torch.device | str] | None,
    dtype: torch.dtype | None,
    strict: bool,
    where: str,
) -> None:
    """Check ``files`` against ``target`` (nothing changes on a mismatch), then stream them."""
    from accel.checkpoint import _stream

    placer = _stream.in_place if device_map is None else _stream.where_mapped(device_map)
    plan = _stream.plan_load(target, files, placer=placer, dtype=dtype)
    if strict and (plan.missing or plan.unexpected):
        raise CheckpointError(
            f"Checkpoint {where!r} does not match the model: missing keys "
            f"{_stream.show(plan.missing)}, unexpected keys {_stream.show(plan.unexpected)}. "
            "Pass `strict=False` to load what matches."
        )
    _stream.warn_unexpected(where, plan.unexpected, stacklevel=3)
    left = plan.left_on_meta()
    if left:
        warnings.warn(
            f"Checkpoint {where!r} has no weights for {_stream.show(left)}; they stay on the "
            "meta device, and the model cannot run until they are loaded.",
            stacklevel=3,
        )
    _stream.stream(plan)


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device_map: str | Mapping[str, str | int | torch.device] | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = False,
) -> nn.Module:
    """Load weights from a file, a folder or an index into ``model``, one file at a time.

    ``checkpoint`` is a ``.safetensors`` file, a torch file (``torch.save`` output or
    ``pytorch_model.bin``, read with ``weights_only=True``: no code in it runs), an
    ``*.index.json`` of shards, or a directory holding one of these (the layout
    ``save_model`` and ``transformers`` write). The files are read one after the other, and
    everything is checked first (keys, shapes, the index's file names), so a load that fails
    leaves the model as it was.

    Tensors already allocated on their device are overwritten in place. Tensors on ``meta``
    (a model built under ``accel.init_empty_weights()``) become real ones without a second
    copy; on the CPU, in the checkpoint's dtype, they stay views of the file's private
    (copy-on-write) memory map, as with ``safetensors.torch.load_file``, so replace a
    checkpoint by writing a new file (as ``accel.save`` and ``save_model`` do) rather than
    overwriting it in place while a model loaded from it is alive. Tied weights stay tied,
    even when the checkpoint holds only one of their names.

    Args:
        model: The model (or a DDP wrapper of it) to load into.
        checkpoint: Where the weights are.
        device_map: ``{module name: device}`` (or ``"auto"``, ``"balanced"``,
            ``"sequential"``); each tensor is read straight to its device. ``"disk"`` needs
            hooks: use ``accel.load_checkpoint_and_dispatch``.
        dtype: Cast floating tensors to it (integers keep theirs).
        strict: Raise on missing or unexpected keys instead of warning about them.

    Returns:
        ``model``.

    Raises:
        CheckpointError: no weights at ``checkpoint``, a malformed index or one naming a path
            outside its directory, a missing, corrupted or refused file (a torch pickle with
            anything but tensors), a shape mismatch, or (``strict``) a key mismatch.
        DeviceMapError: a bad ``device_map``, or one that puts something on ``"disk"``.

    Example:
        >>> accel.load_checkpoint_in_model(model, "out")   # the folder save_model wrote
    """
    from accel.checkpoint._stream import DISK, as_dtype
    from accel.errors import DeviceMapError

    target = unwrap_model(as_module(model, "accel.load_checkpoint_in_model"))
    as_path(checkpoint, "accel.load_checkpoint_in_model", "checkpoint")
    cast = as_dtype(dtype)
    placed: dict[str, torch.device | str] | None = None
    if device_map is not None:
        from accel.big_model.device_map import resolve_device_map

        placed = resolve_device_map(target, device_map, dtype=cast)
        on_disk = [name for name, where in placed.items() if where == DISK]
        if on_disk:
            raise DeviceMapError(
                f"device_map puts {on_disk!r} on 'disk'; load_checkpoint_in_model cannot run "
                "a model from disk. Use `accel.load_checkpoint_and_dispatch(model, checkpoint, "
                "device_map=..., offload_folder=...)`, which adds the hooks that do."
            )
    def read(at: Path) -> None:
        files = _checkpoint_files(at)
        where = os.fspath(checkpoint)
        _read_into(target, files, device_map=placed, dtype=cast, strict=strict, where=where)

    path = Path(checkpoint)
    source = _resolve(path)
    try:
        read(source)
    except (CheckpointError, OSError):
        if source == path or not os.path.lexists(path):
            raise
        read(path)  # the old copy was put back in place meanwhile (by a save): read it there
    return model

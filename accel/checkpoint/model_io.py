"""Model weights: ``save``, ``save_model`` (HF layout), ``load_checkpoint_in_model``."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel._sizes import parse_size
from accel.checkpoint import _model_swap
from accel.checkpoint._atomic import leftovers, temp_sibling, write_file_atomically
from accel.checkpoint._format import write_bytes, write_safetensors
from accel.errors import CheckpointError
from accel.model import unwrap_model

__all__ = ["get_state_dict", "load", "load_checkpoint_in_model", "save", "save_model"]

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


def get_state_dict(model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
    """The model's full state dict, with the unwrapped module's keys (no ``module.`` prefix).

    Example:
        >>> sd = accel.get_state_dict(model)   # a DDP model gives the bare module's keys
    """
    target = unwrap_model(model) if unwrap else model
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


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


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

    target = Path(path)
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

    return _single.read_file(Path(path), map_location)


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
    gathered); only the main process writes, or with ``on_each_node=True`` (default
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

    out = Path(directory)
    limit = _parse_size(max_shard_size)
    each = _nodes.resolve(on_each_node, "save_model")
    tensors = get_state_dict(model)
    if not _nodes.writes(each):
        return out
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
                _write_shard(shard, safe_serialization, new / name)
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
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"Index {where!r} is not valid JSON ({exc}). {fix}") from None
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
    raise CheckpointError(
        f"No weights at {os.fspath(checkpoint)!r}: expected a .safetensors/.bin file, an "
        f"index.json, or a directory holding {SAFE_WEIGHTS}, {SAFE_INDEX}, {TORCH_WEIGHTS} or "
        f"{TORCH_INDEX}."
    )


def _iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(os.fspath(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield key, f.get_tensor(key)
        except SafetensorError as exc:
            raise CheckpointError(f"Weights file {os.fspath(path)!r} is corrupted: {exc}") from None
        return
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError) as exc:  # torch reports bad archives this way
        raise CheckpointError(f"Weights file {os.fspath(path)!r} is corrupted: {exc}") from None
    if not _is_tensor_dict(loaded):
        raise CheckpointError(f"{os.fspath(path)!r} does not hold a state dict of tensors.")
    yield from loaded.items()


def _read_into(
    target: nn.Module, files: list[Path], dtype: torch.dtype | None
) -> tuple[set[str], list[str]]:
    """Load ``files`` into ``target`` one at a time; return the missing and unexpected keys."""
    own = target.state_dict()
    missing = set(own)
    unexpected: list[str] = []
    for file in files:
        if not file.is_file():
            raise CheckpointError(
                f"Weights file {os.fspath(file)!r} named by the index is missing."
            )
        part: dict[str, torch.Tensor] = {}
        cast: dict[str, torch.Tensor] = {}  # placed as the new parameters: their dtype changes
        for key, tensor in _iter_file(file):
            if key not in own:
                unexpected.append(key)
                continue
            if dtype is not None and tensor.is_floating_point():
                cast[key] = tensor.to(device=own[key].device, dtype=dtype)
            else:
                part[key] = tensor
            missing.discard(key)
        target.load_state_dict(part, strict=False)
        if cast:
            target.load_state_dict(cast, strict=False, assign=True)
        del part, cast
    return missing, unexpected


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device_map: Mapping[str, str | int | torch.device] | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = False,
) -> nn.Module:
    """Load weights from a file, a folder or an index into ``model``, one file at a time.

    Reads safetensors, or torch ``.bin`` files with ``weights_only=True`` (no code runs).
    Floating tensors are cast to ``dtype`` when given. ``device_map`` maps submodule names to
    devices to move them to after loading. With ``strict``, missing or unexpected keys raise.
    An index is checked before anything is loaded: its ``weight_map`` must name plain files
    in the index's directory.

    Raises:
        CheckpointError: no weights at ``checkpoint``, a malformed index or one naming a path
            outside its directory, a missing or corrupted file, or (``strict``) a key mismatch.

    Example:
        >>> accel.load_checkpoint_in_model(model, "out")   # the folder save_model wrote
    """
    target = unwrap_model(model)
    path = Path(checkpoint)
    source = _resolve(path)
    try:
        missing, unexpected = _read_into(target, _checkpoint_files(source), dtype)
    except (CheckpointError, OSError):
        if source == path or not os.path.lexists(path):
            raise
        # the old copy was put back in place meanwhile (by a save): read it there
        missing, unexpected = _read_into(target, _checkpoint_files(path), dtype)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"Checkpoint {os.fspath(checkpoint)!r} does not match the model: missing keys "
            f"{sorted(missing)[:10]}, unexpected keys {unexpected[:10]}. Pass `strict=False` "
            "to load what matches."
        )
    for name, device in (device_map or {}).items():
        module = target.get_submodule(name) if name else target
        module.to(device if not isinstance(device, int) else torch.device("cuda", device))
    return model

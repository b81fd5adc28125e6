"""Model weights: ``save``, ``save_model`` (HF layout), ``load``, ``get_state_dict``."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel._files.atomic import temp_sibling, write_file_atomically
from accel._files.format import write_bytes, write_safetensors
from accel._files.paths import as_module, as_path
from accel.core.sizes import parse_shard_size
from accel.errors import CheckpointError
from accel.parallel.engines.registry import ENGINES
from accel.training.model import unwrap_model
from accel.weights import _model_swap
from accel.weights import full as _full_weights
from accel.weights.files import (
    SAFE_INDEX,
    SAFE_WEIGHTS,
    TORCH_INDEX,
    TORCH_WEIGHTS,
    is_complete,
)
from accel.weights.ties import tie_map

__all__ = ["get_state_dict", "load", "save", "save_model"]


def get_state_dict(model: nn.Module, *, unwrap: bool = True) -> dict[str, torch.Tensor]:
    """The model's full state dict, with the unwrapped module's keys (no ``module.`` prefix).

    For an FSDP-sharded model every rank must call it: each tensor is gathered in turn, and
    every rank gets the full (unsharded) state dict on the CPU.

    Example:
        >>> sd = accel.get_state_dict(model)   # a DDP model gives the bare module's keys
    """
    target = unwrap_model(as_module(model, "accel.get_state_dict")) if unwrap else model
    if _pipelined(target):  # every stage's weights, gathered from every rank
        from accel.parallel.pipeline.weights import all_stages

        stage = _full_weights.sharded_state(target)
        local = (_full_weights.gather(stage) if stage is not None
                 else {k: v.detach() for k, v in target.state_dict().items()})
        return all_stages(target, local)
    sharded = _full_weights.sharded_state(target)
    if sharded is not None:
        return _full_weights.gather(sharded)
    for engine in ENGINES.values():  # weights only the engine can gather (ZeRO-3 partitions)
        full = engine.full_state_dict(target)
        if full is not None:
            return full
    return {k: v.detach() for k, v in target.state_dict().items()}


def _pipelined(module: nn.Module) -> bool:
    from accel.parallel.pipeline.stages import pipeline_of

    return pipeline_of(module) is not None


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
    from accel._files import nodes as _nodes
    from accel.weights import _single

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
    from accel.weights import _single

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
    from accel._files import nodes as _nodes

    out = as_path(directory, "accel.save_model", "directory")
    as_module(model, "accel.save_model")
    limit = parse_shard_size(max_shard_size, example="10GB")
    each = _nodes.resolve(on_each_node, "save_model")
    module = unwrap_model(model)
    # FSDP: gathered file by file (a pipelined model's stages: all at once, every rank)
    sharded = None if _pipelined(module) else _full_weights.sharded_state(module)
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
        _model_swap.recover(target, is_complete)  # finish a save that was killed
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

"""Stream a checkpoint into a (meta) model, placed by a device map: ``load_checkpoint_in_model``
(placement only) and ``load_checkpoint_and_dispatch`` (offload and hooks too)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel._files.paths import as_module, as_path
from accel.big_model.device_map import resolve_device_map
from accel.big_model.dispatch import dispatch_with_sources
from accel.big_model.hooks import Placement
from accel.big_model.offload import TensorSource, write_offload_file
from accel.errors import CheckpointError, DeviceMapError
from accel.training.model import unwrap_model
from accel.weights import stream as _stream
from accel.weights.files import resolve_weights, weight_files

__all__ = ["load_checkpoint_and_dispatch", "load_checkpoint_in_model"]


def _public(device_map: Mapping[str, torch.device | str]) -> dict[str, int | str]:
    """A normalized map written the way Accelerate's ``hf_device_map`` writes it: GPU
    indices as ints, ``"cpu"``, ``"disk"``."""
    out: dict[str, int | str] = {}
    for name, where in device_map.items():
        if isinstance(where, torch.device) and where.type == "cuda" and where.index is not None:
            out[name] = where.index
        else:
            out[name] = str(where)
    return out


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device_map: str | Mapping[str, int | str | torch.device] | None = "auto",
    max_memory: Mapping[Any, int | str] | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | str | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> nn.Module:
    """Load a checkpoint into ``model`` file by file, placing each tensor by a device map.

    ``model`` is typically built under ``accel.init_empty_weights()``. ``checkpoint`` is a
    ``.safetensors`` file, a torch file (``torch.save`` output or ``pytorch_model.bin``, read
    with ``weights_only=True``: no code in it runs), an ``*.index.json``, or a directory
    holding ``model.safetensors``, ``pytorch_model.bin`` or a sharded index.

    The device map is resolved first (``"auto"``/``"balanced"``, ``"sequential"``, or an
    explicit ``{module name: device}``), then everything is checked against the checkpoint
    before the model changes. The files are read one at a time: each tensor is made on its
    device directly, so memory peaks at the model's resident size plus one file. Weights
    mapped to ``"disk"`` are not read when the file is safetensors: the shard is memory-mapped
    in place at run time. A torch file's disk weights are written to ``offload_folder`` as
    safetensors. Forward hooks then move offloaded weights to the execution device for each
    forward (skipped when the whole model sits on one device); ``model.hf_device_map`` records
    the map as Accelerate writes it. Tied weights stay tied.

    CPU weights in the checkpoint's dtype are views of the file's private (copy-on-write)
    memory map, as with ``safetensors`` itself (and ``torch.load(mmap=True)``): replace a
    checkpoint by writing a new file and renaming it (``accel.save`` and ``save_model`` do)
    rather than overwriting it in place while a model loaded from it is alive.

    Args:
        model: The model to load into.
        checkpoint: Where the weights are.
        device_map: ``"auto"``, ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``, an
            explicit map, or ``None`` to load every tensor where it is (``meta`` ones on the
            CPU), no hooks.
        max_memory: Budgets per device (``0``, ``1``, ..., ``"cpu"``, ``"disk"``) in bytes or
            strings such as ``"10GiB"``; defaults to what is free.
        no_split_module_classes: Module classes (or their names) never split across devices;
            default: the blocks the model declares (transformers' ``_no_split_modules``).
        offload_folder: Where disk weights from torch files are written.
        dtype: Cast floating tensors to it (integers keep theirs).

    Returns:
        ``model``, loaded and dispatched.

    Raises:
        DeviceMapError: a bad ``device_map`` or ``max_memory``, or disk weights that must be
            written while ``offload_folder`` is None.
        CheckpointError: no weights at ``checkpoint``, a missing, corrupted or refused file,
            a tensor of the model the checkpoint lacks, or a shape mismatch. Unexpected keys
            are a warning.

    Example:
        >>> with accel.init_empty_weights():
        ...     model = MyModel()
        >>> model = accel.load_checkpoint_and_dispatch(model, "ckpt", device_map="auto",
        ...                                            offload_folder="offload")
    """
    cast = _stream.as_dtype(dtype)
    placed = None
    if device_map is not None:
        placed = resolve_device_map(
            model,
            device_map,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            dtype=cast,
        )
    plan = _checked_plan(model, checkpoint, placed, cast)
    _check_offload_folder(plan, placed, offload_folder)

    def write(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        assert offload_folder is not None
        return write_offload_file(offload_folder, tensors, name=name).path

    sources = _stream.stream(plan, write=None if offload_folder is None else write)
    if placed is None:
        return model
    devices = set(placed.values())
    if len(devices) == 1 and _stream.DISK not in devices:
        model.to(next(iter(devices)))  # every tensor is there already: moves nothing else
    else:
        dispatch_with_sources(
            model,
            placed,
            {k: TensorSource(s.path, s.key, s.dtype) for k, s in sources.items()},
            offload_dir=offload_folder,
        )
    shown = dict(device_map) if isinstance(device_map, Mapping) else _public(placed)
    setattr(model, "hf_device_map", shown)  # noqa: B010 - Module.__setattr__ is typed for tensors
    return model


def _checked_plan(
    model: nn.Module, checkpoint: str | os.PathLike[str],
    placed: Mapping[str, Placement] | None, cast: torch.dtype | None,
) -> _stream.Plan:
    """Where each checkpoint tensor goes; refused when a model tensor would stay on ``meta``,
    a warning (pointing at the caller of ``load_checkpoint_and_dispatch``) for the others."""
    where = os.fspath(as_path(checkpoint, "accel.load_checkpoint_and_dispatch", "checkpoint"))
    files = weight_files(resolve_weights(Path(checkpoint)))
    placer = _stream.in_place if placed is None else _stream.where_mapped(placed)
    plan = _stream.plan_load(model, files, placer=placer, dtype=cast)
    left = plan.left_on_meta()
    if left:
        raise CheckpointError(
            f"Checkpoint {where!r} has no weights for {_stream.show(left)} of the model: they "
            "would stay on the meta device and the model could not run. Check that the "
            f"checkpoint was saved from this model (keys it has but the model does not: "
            f"{_stream.show(plan.unexpected)}); buffers that are not saved must be built "
            "with real values (keep `include_buffers=False` in init_empty_weights)."
        )
    if plan.missing:
        warnings.warn(
            f"Checkpoint {where!r} has no weights for {_stream.show(plan.missing)}; they keep "
            "the values the model was built with.",
            stacklevel=3,
        )
    _stream.warn_unexpected(where, plan.unexpected, stacklevel=3)
    return plan


def _check_offload_folder(
    plan: _stream.Plan, placed: Mapping[str, Placement] | None,
    offload_folder: str | os.PathLike[str] | None,
) -> None:
    """Refuse disk weights that must be written (from a torch file) without a folder."""
    pending = plan.to_write()
    if pending and offload_folder is None:
        modules = sorted({n for n, d in (placed or {}).items() if d == _stream.DISK})
        raise DeviceMapError(
            f"The device map puts {_stream.show(modules)} on 'disk', and weights "
            f"{_stream.show(pending)} must be written there (they come from a torch file, "
            "which cannot be mapped in place) but offload_folder is None. Pass "
            "`offload_folder='offload'` (any directory), or save the checkpoint as "
            "safetensors (`accel.save_model(model, dir)`) so it is mapped where it is."
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
    target = unwrap_model(as_module(model, "accel.load_checkpoint_in_model"))
    as_path(checkpoint, "accel.load_checkpoint_in_model", "checkpoint")
    cast = _stream.as_dtype(dtype)
    placed: dict[str, torch.device | str] | None = None
    if device_map is not None:
        placed = resolve_device_map(target, device_map, dtype=cast)
        on_disk = [name for name, where in placed.items() if where == _stream.DISK]
        if on_disk:
            raise DeviceMapError(
                f"device_map puts {on_disk!r} on 'disk'; load_checkpoint_in_model cannot run "
                "a model from disk. Use `accel.load_checkpoint_and_dispatch(model, checkpoint, "
                "device_map=..., offload_folder=...)`, which adds the hooks that do."
            )
    def read(at: Path) -> None:
        files = weight_files(at)
        where = os.fspath(checkpoint)
        _read_into(target, files, device_map=placed, dtype=cast, strict=strict, where=where)

    path = Path(checkpoint)
    source = resolve_weights(path)
    try:
        read(source)
    except (CheckpointError, OSError):
        if source == path or not os.path.lexists(path):
            raise
        read(path)  # the old copy was put back in place meanwhile (by a save): read it there
    return model

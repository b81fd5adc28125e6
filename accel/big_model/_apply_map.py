"""Applying a checked device map: where each tensor of the model lives, and its hooks.

:func:`apply_map` is the one engine behind ``dispatch_model``, ``cpu_offload``,
``disk_offload`` and ``load_checkpoint_and_dispatch`` (:mod:`accel.big_model.dispatch`). It
finds every tensor object (tied names share one), where each use of it runs, and its home:
the first device a use keeps it on, else CPU RAM, else a file (an offload file it writes, or
the checkpoint file a ``meta`` tensor's bytes are in). Everything is checked before the model
changes; then tensors are moved or replaced by ``meta`` placeholders and the forward hooks
of :mod:`accel.big_model.hooks` are installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
from torch import nn

from accel.big_model.hooks import (
    DISK,
    DISPATCH_ATTR,
    Dispatch,
    Placement,
    Slot,
    Weight,
    covering_entry,
    plan_hooks,
)
from accel.big_model.offload import MappedFile, TensorSource, map_sources, write_offload_file
from accel.checkpoint._values import dtype_kind
from accel.errors import CheckpointError, DeviceMapError

__all__ = [
    "CPU", "DEVICE_MAP_ATTR", "apply_map", "checked_offload_dir", "existing_dispatches",
    "main_device",
]

CPU = torch.device("cpu")
DEVICE_MAP_ATTR = "hf_device_map"
# data a model tensor of each kind never takes from a file: integer bits read as floats
_REFUSED_KINDS = {"floating": ("integer", "bool", "complex"), "complex": ("integer", "bool")}


@attrs.define(eq=False)
class _Use:
    """One module attribute holding a tensor, and where its placement says it runs."""

    module: nn.Module
    module_name: str
    attr: str
    exec_device: torch.device
    offloaded: bool  # kept outside ``exec_device`` between forwards
    to_disk: bool


@attrs.define(eq=False)
class _Tensor:
    """One tensor object of the model (tied names share it) and its uses."""

    tensor: torch.Tensor
    names: list[str]
    is_param: bool
    persistent: bool
    uses: list[_Use] = attrs.field(factory=list)


def _collect(model: nn.Module) -> tuple[dict[int, _Tensor], dict[str, nn.Module]]:
    """Every tensor object of ``model`` with all its names, and the modules by first name."""
    tensors: dict[int, _Tensor] = {}
    modules: dict[str, nn.Module] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        modules.setdefault(module_name, module)
        prefix = f"{module_name}." if module_name else ""
        for attr, tensor in module._parameters.items():
            if tensor is not None:
                entry = tensors.setdefault(id(tensor), _Tensor(tensor, [], True, True))
                entry.names.append(prefix + attr)
        for attr, tensor in module._buffers.items():
            if tensor is not None:
                persistent = attr not in module._non_persistent_buffers_set
                entry = tensors.setdefault(id(tensor), _Tensor(tensor, [], False, persistent))
                entry.names.append(prefix + attr)
    return tensors, modules


def existing_dispatches(model: nn.Module) -> list[tuple[nn.Module, Dispatch]]:
    return [(m, m.__dict__[DISPATCH_ATTR]) for m in model.modules() if DISPATCH_ATTR in m.__dict__]


def _meta_like(tensor: torch.Tensor, dtype: torch.dtype, is_param: bool) -> torch.Tensor:
    if tensor.device.type == "meta" and tensor.dtype == dtype:
        return tensor
    meta = torch.empty(tensor.shape, dtype=dtype, device="meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_param else meta


def _new_value(tensor: torch.Tensor, value: torch.Tensor, is_param: bool) -> torch.Tensor:
    return nn.Parameter(value, requires_grad=tensor.requires_grad) if is_param else value


@attrs.define(eq=False)
class _Origin:
    """Where the bytes of a ``meta`` tensor are: a source file or a previous dispatch."""

    value: torch.Tensor  # CPU: a file view or a tensor in RAM
    dtype: torch.dtype
    file: MappedFile | None = None
    key: str = ""

    def materialize(self, device: torch.device) -> torch.Tensor:
        if self.file is not None:  # read from the open file, not the map: no SIGBUS
            return self.file.read(self.key).to(device=device, dtype=self.dtype)
        return self.value.to(device=device, dtype=self.dtype)


def _origins(
    tensors: dict[int, _Tensor],
    carried: Mapping[int, Weight],
    sources: Mapping[str, TensorSource] | None,
) -> dict[int, _Origin]:
    """For every ``meta`` tensor, where its bytes are; checked before anything changes."""
    by_name = {name: t for t in tensors.values() for name in t.names}
    mapped: dict[str, tuple[MappedFile, str]] = {}
    wanted: dict[str, torch.dtype | None] = {}
    if sources:
        unknown = [name for name in sources if name not in by_name]
        if unknown:
            raise CheckpointError(
                f"Sources were given for {unknown[:8]!r}, which are not parameters or buffers "
                "of the model. Check that the checkpoint matches the model."
            )
        shapes = {name: tuple(by_name[name].tensor.shape) for name in sources}
        mapped = map_sources(sources, shapes)
        wanted = {name: source.dtype for name, source in sources.items()}
    out: dict[int, _Origin] = {}
    for key, t in tensors.items():
        if t.tensor.device.type != "meta":
            continue
        weight = carried.get(key)
        if weight is not None:
            out[key] = _Origin(weight.source, weight.dtype, weight.file, weight.key)
            continue
        name = next((n for n in t.names if n in mapped), None)
        if name is None:
            raise DeviceMapError(
                f"{t.names[0]!r} is on the meta device: the model has no weights for it, so "
                "it cannot be dispatched. Load the weights first, e.g. with "
                "`accel.load_checkpoint_and_dispatch(model, checkpoint, device_map=...)`; if "
                "an enclosing model was dispatched, call `accel.remove_hooks` on it first."
            )
        file, file_key = mapped[name]
        cast = wanted[name]
        stored = dtype_kind(file.dtype(file_key))
        if stored in _REFUSED_KINDS.get(dtype_kind(t.tensor.dtype), ()):
            raise CheckpointError(
                f"Weights file {os.fspath(file.path)!r} holds {file_key!r} as "
                f"{file.dtype(file_key)}, and {name!r} is {t.tensor.dtype}: its bytes would be "
                "read as other numbers (the file was changed or crafted). Load the model again "
                "from a checkpoint of its own dtypes."
            )
        floating = file.dtype(file_key).is_floating_point
        dtype = cast if cast is not None and floating else t.tensor.dtype
        out[key] = _Origin(file.tensor(file_key), dtype, file, file_key)
    return out


def checked_offload_dir(offload_dir: str | os.PathLike[str] | None, what: str) -> Path:
    if offload_dir is None:
        raise DeviceMapError(
            f"{what}, but offload_dir is None. Pass `offload_dir='offload'` (any folder with "
            "room for those weights; it is created when missing)."
        )
    path = Path(offload_dir)
    if path.exists() and not path.is_dir():
        raise DeviceMapError(
            f"offload_dir={os.fspath(offload_dir)!r} is a file, not a folder. Pass a folder "
            "(it is created when missing)."
        )
    return path


def apply_map(
    model: nn.Module,
    device_map: Mapping[str, Placement],
    *,
    main: torch.device,
    offload_cpu: bool,
    offload_dir: str | os.PathLike[str] | None,
    sources: Mapping[str, TensorSource] | None,
    offload_buffers: bool,
    preload: tuple[type[nn.Module] | str, ...],
    force_hooks: bool,
    shown_map: Mapping[str, object] | None,
) -> nn.Module:
    records = existing_dispatches(model)
    for _, record in records:  # re-tie weights a previous dispatch kept on another device
        for slot in record.slots:
            if slot.weight.restore is not None:
                slot.fill(slot.weight.restore)
    carried = {id(s.weight.placeholder): s.weight for _, rec in records for s in rec.slots}
    tensors, modules = _collect(model)
    origins = _origins(tensors, carried, sources)

    # where each use of each tensor runs (a module registered under two names is one use)
    for t in tensors.values():
        seen: set[tuple[int, str]] = set()
        for name in t.names:
            module_name, _, attr = name.rpartition(".")
            if (id(modules[module_name]), attr) in seen:
                continue
            seen.add((id(modules[module_name]), attr))
            entry = covering_entry(device_map, name)
            if entry is None:
                raise DeviceMapError(
                    f"The device map does not place {name!r}. Add its module (or an "
                    "ancestor) to the map."
                )
            where = device_map[entry]
            if where == DISK:
                offloaded, to_disk, device = True, True, main
            elif where == CPU and offload_cpu:
                offloaded, to_disk, device = True, False, main
            else:
                offloaded, to_disk, device = False, False, torch.device(where)
            if not t.is_param and (not t.persistent or not offload_buffers):
                offloaded = to_disk = False  # buffers stay on the execution device
            t.uses.append(_Use(modules[module_name], module_name, attr, device, offloaded, to_disk))

    # each tensor's home: the first device a use keeps it on, else RAM, else a file
    to_write: dict[str, torch.Tensor] = {}
    homes: dict[int, torch.device | str] = {}
    for key, t in tensors.items():
        resident = [u for u in t.uses if not u.offloaded]
        if resident:
            homes[key] = resident[0].exec_device
        elif all(u.to_disk for u in t.uses):
            homes[key] = DISK
            origin = origins.get(key)
            if origin is None or origin.file is None:
                value = t.tensor if origin is None else origin.value.to(origin.dtype)
                to_write[t.names[0]] = value.detach()
        else:
            homes[key] = "ram"
    written: dict[str, MappedFile] = {}  # name -> the offload file it was written to
    if to_write:
        disk_modules = sorted(n for n, d in device_map.items() if d == DISK)
        what = f"The device map puts {disk_modules[:8]!r} on 'disk'"
        folder = checked_offload_dir(offload_dir, what)
        written = dict.fromkeys(to_write, write_offload_file(folder, to_write))

    # nothing has changed so far; from here on the model is modified
    for module, record in records:
        record.remove_handles()
        del module.__dict__[DISPATCH_ATTR]
        if module is not model:
            module.__dict__.pop(DEVICE_MAP_ATTR, None)

    dispatch = Dispatch()
    for key, t in tensors.items():
        home = homes[key]
        origin = origins.get(key)
        if isinstance(home, torch.device):
            if origin is not None:
                value = _new_value(t.tensor, origin.materialize(home), t.is_param)
            else:
                value = _move(t.tensor, home, t.is_param)
            for use in t.uses:
                if use.exec_device == home:
                    _fill(use, value, t.is_param)
            others = [u for u in t.uses if u.exec_device != home]
            if others:  # tied to a module running elsewhere: brought there for its forwards
                placeholder = _meta_like(t.tensor, value.dtype, t.is_param)
                by_device: dict[torch.device, Weight] = {}
                for use in others:
                    weight = by_device.get(use.exec_device)
                    if weight is None:
                        weight = by_device[use.exec_device] = Weight(
                            value, placeholder, use.exec_device, restore=value
                        )
                    dispatch.slots.append(Slot(use.module, use.attr, weight))
            continue
        dtype = origin.dtype if origin is not None else t.tensor.dtype
        placeholder = _meta_like(t.tensor, dtype, t.is_param)
        if home == DISK:
            if origin is not None and origin.file is not None:
                weight = Weight(origin.value, placeholder, main, file=origin.file, key=origin.key)
            else:
                file = written[t.names[0]]
                view = file.tensor(t.names[0])
                weight = Weight(view, placeholder, main, file=file, key=t.names[0])
        else:  # RAM
            if origin is None:
                source = t.tensor.detach().to(CPU)
            elif origin.file is None:
                source = origin.value
            else:
                source = origin.materialize(CPU)
            weight = Weight(source, placeholder, main)
        for use in t.uses:
            dispatch.slots.append(Slot(use.module, use.attr, weight))

    hooks = {}
    devices = set(device_map.values())
    if force_hooks or len(devices) > 1 or DISK in devices:
        hooks = plan_hooks(model, modules, device_map, dispatch.slots, main, offload_cpu, preload)
    dispatch.install(hooks)
    model.__dict__[DISPATCH_ATTR] = dispatch
    if shown_map is not None:
        setattr(model, DEVICE_MAP_ATTR, dict(shown_map))
    return model


def _move(tensor: torch.Tensor, device: torch.device, is_param: bool) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if is_param:  # keep the parameter object (an optimizer or a tie may hold it)
        with torch.no_grad():
            tensor.data = tensor.data.to(device)
        return tensor
    return tensor.to(device)


def _fill(use: _Use, value: torch.Tensor, is_param: bool) -> None:
    if is_param:
        use.module._parameters[use.attr] = value  # type: ignore[assignment]
    else:
        use.module._buffers[use.attr] = value


def main_device(device_map: Mapping[str, Placement]) -> torch.device:
    for where in device_map.values():
        if isinstance(where, torch.device) and where.type != "cpu":
            return where
    return CPU

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

from accel._files.values import dtype_kind
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
    in_offload: bool = False  # its map entry is offloaded (``"disk"``, or ``"cpu"`` beside a GPU)


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
    """Place every tensor of ``model`` as ``device_map`` says and install its hooks.

    Everything is checked and offload files are written before the model changes; a previous
    dispatch of the model (or of a submodule) is replaced.

    Raises:
        DeviceMapError: the map leaves a tensor unplaced, a ``meta`` tensor has no weights, or
            disk offload lacks a usable ``offload_dir``.
        CheckpointError: ``sources`` do not match the model's tensors.
    """
    records = existing_dispatches(model)
    carried = _carried_weights(records)
    tensors, modules = _collect(model)
    origins = _origins(tensors, carried, sources)
    _place_uses(tensors, modules, device_map, main, offload_cpu, offload_buffers)
    homes, to_write = _homes(tensors, origins)
    written = _write_offloads(to_write, device_map, offload_dir)
    # nothing has changed so far; from here on the model is modified
    _remove_dispatches(model, records)
    dispatch = Dispatch()
    for key, t in tensors.items():
        home, origin = homes[key], origins.get(key)
        if isinstance(home, torch.device):
            dispatch.slots += _resident_slots(t, home, origin)
            if not t.is_param and home.type != "cpu":  # remove_hooks brings these back
                dispatch.home_buffers += [(u.module, u.attr) for u in t.uses if u.in_offload]
            continue
        weight = _offloaded_weight(t, home, origin, written, main)
        dispatch.slots += [Slot(use.module, use.attr, weight) for use in t.uses]
    hooks = {}
    devices = set(device_map.values())
    if force_hooks or len(devices) > 1 or DISK in devices:
        hooks = plan_hooks(model, modules, device_map, dispatch.slots, main, offload_cpu, preload)
    dispatch.install(hooks)
    model.__dict__[DISPATCH_ATTR] = dispatch
    if shown_map is not None:
        setattr(model, DEVICE_MAP_ATTR, dict(shown_map))
    return model


def _carried_weights(records: list[tuple[nn.Module, Dispatch]]) -> dict[int, Weight]:
    """The weights of previous dispatches by their placeholder, ties they split re-made."""
    for _, record in records:  # re-tie weights a previous dispatch kept on another device
        for slot in record.slots:
            if slot.weight.restore is not None:
                slot.fill(slot.weight.restore)
    return {id(s.weight.placeholder): s.weight for _, rec in records for s in rec.slots}


def _place_uses(
    tensors: dict[int, _Tensor], modules: dict[str, nn.Module],
    device_map: Mapping[str, Placement], main: torch.device, offload_cpu: bool,
    offload_buffers: bool,
) -> None:
    """Record where each use of each tensor runs (a module under two names is one use)."""
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
            region = offloaded
            if not t.is_param and (not t.persistent or not offload_buffers):
                offloaded = to_disk = False  # buffers stay on the execution device
            t.uses.append(_Use(modules[module_name], module_name, attr, device, offloaded, to_disk,
                               region))


def _homes(
    tensors: dict[int, _Tensor], origins: Mapping[int, _Origin]
) -> tuple[dict[int, torch.device | str], dict[str, torch.Tensor]]:
    """Each tensor's home (the first device a use keeps it on, else RAM, else a file), and
    the tensors to write to an offload file (by first name)."""
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
    return homes, to_write


def _write_offloads(
    to_write: dict[str, torch.Tensor], device_map: Mapping[str, Placement],
    offload_dir: str | os.PathLike[str] | None,
) -> dict[str, MappedFile]:
    """Write the tensors offloaded to disk; each name's offload file."""
    if not to_write:
        return {}
    disk_modules = sorted(n for n, d in device_map.items() if d == DISK)
    what = f"The device map puts {disk_modules[:8]!r} on 'disk'"
    folder = checked_offload_dir(offload_dir, what)
    return dict.fromkeys(to_write, write_offload_file(folder, to_write))


def _remove_dispatches(model: nn.Module, records: list[tuple[nn.Module, Dispatch]]) -> None:
    for module, record in records:
        record.remove_handles()
        del module.__dict__[DISPATCH_ATTR]
        if module is not model:
            module.__dict__.pop(DEVICE_MAP_ATTR, None)


def _resident_slots(t: _Tensor, home: torch.device, origin: _Origin | None) -> list[Slot]:
    """Put a tensor on its home device; the slots of its uses that run on other devices."""
    if origin is not None:
        value = _new_value(t.tensor, origin.materialize(home), t.is_param)
    else:
        value = _move(t.tensor, home, t.is_param)
    for use in t.uses:
        if use.exec_device == home:
            _fill(use, value, t.is_param)
    others = [u for u in t.uses if u.exec_device != home]
    if not others:
        return []
    # tied to a module running elsewhere: brought there for its forwards
    placeholder = _meta_like(t.tensor, value.dtype, t.is_param)
    by_device: dict[torch.device, Weight] = {}
    slots = []
    for use in others:
        weight = by_device.get(use.exec_device)
        if weight is None:
            weight = by_device[use.exec_device] = Weight(
                value, placeholder, use.exec_device, restore=value
            )
        slots.append(Slot(use.module, use.attr, weight))
    return slots


def _offloaded_weight(
    t: _Tensor, home: torch.device | str, origin: _Origin | None,
    written: Mapping[str, MappedFile], main: torch.device,
) -> Weight:
    """The weight of a tensor kept in RAM or in a file, brought to ``main`` for forwards."""
    dtype = origin.dtype if origin is not None else t.tensor.dtype
    placeholder = _meta_like(t.tensor, dtype, t.is_param)
    if home == DISK:
        if origin is not None and origin.file is not None:
            return Weight(origin.value, placeholder, main, file=origin.file, key=origin.key)
        file = written[t.names[0]]
        view = file.tensor(t.names[0])
        return Weight(view, placeholder, main, file=file, key=t.names[0])
    if origin is None:  # RAM
        source = t.tensor.detach().to(CPU)
    elif origin.file is None:
        source = origin.value
    else:
        source = origin.materialize(CPU)
    return Weight(source, placeholder, main)


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

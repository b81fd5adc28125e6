"""``dispatch_model``, ``cpu_offload``, ``disk_offload``, ``remove_hooks``.

A device map sends each submodule to a device, to ``"cpu"`` or to ``"disk"``. Modules on a
device stay there. Offloaded modules (``"disk"``, and ``"cpu"`` when a GPU is in the map)
keep their weights outside the execution device (the map's first GPU, else the CPU) on
``meta`` placeholders; forward hooks bring them in for each forward and release them after.
Disk weights are safetensors files mapped once, copy-on-write: with the CPU as execution
device a forward reads the file's pages directly, without copying them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
import torch
from torch import nn

from accel.big_model.device_map import check_device_map, normalize_device
from accel.big_model.hooks import (
    DISK,
    DISPATCH_ATTR,
    Dispatch,
    Placement,
    Slot,
    Weight,
    covering_entry,
    plan_hooks,
    preload_classes,
)
from accel.big_model.offload import MappedFile, TensorSource, map_sources, write_offload_file
from accel.errors import CheckpointError, DeviceMapError

__all__ = ["cpu_offload", "disk_offload", "dispatch_model", "remove_hooks"]

_CPU = torch.device("cpu")
_DEVICE_MAP_ATTR = "hf_device_map"


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


def _existing(model: nn.Module) -> list[tuple[nn.Module, Dispatch]]:
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
        value = self.value.to(device=device, dtype=self.dtype)
        return value.clone() if value is self.value and self.file is not None else value


def _origins(
    tensors: dict[int, _Tensor],
    carried: Mapping[int, Weight],
    sources: Mapping[str, TensorSource] | None,
) -> dict[int, _Origin]:
    """For every ``meta`` tensor, where its bytes are; checked before anything changes."""
    by_name = {name: t for t in tensors.values() for name in t.names}
    mapped: dict[str, tuple[MappedFile, str]] = {}
    if sources:
        unknown = [name for name in sources if name not in by_name]
        if unknown:
            raise CheckpointError(
                f"Sources were given for {unknown[:8]!r}, which are not parameters or buffers "
                "of the model. Check that the checkpoint matches the model."
            )
        shapes = {name: tuple(by_name[name].tensor.shape) for name in sources}
        mapped = map_sources(sources, shapes)
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
        assert sources is not None
        wanted = sources[name].dtype
        floating = file.dtype(file_key).is_floating_point
        dtype = wanted if wanted is not None and floating else t.tensor.dtype
        out[key] = _Origin(file.tensor(file_key), dtype, file, file_key)
    return out


def _offload_dir(offload_dir: str | os.PathLike[str] | None, what: str) -> Path:
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


def _dispatch(
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
    records = _existing(model)
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
            elif where == _CPU and offload_cpu:
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
    written: MappedFile | None = None
    if to_write:
        disk_modules = sorted(n for n, d in device_map.items() if d == DISK)
        what = f"The device map puts {disk_modules[:8]!r} on 'disk'"
        folder = _offload_dir(offload_dir, what)
        written = write_offload_file(folder, to_write)

    # nothing has changed so far; from here on the model is modified
    for module, record in records:
        record.remove_handles()
        del module.__dict__[DISPATCH_ATTR]
        if module is not model:
            module.__dict__.pop(_DEVICE_MAP_ATTR, None)

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
                assert written is not None
                view = written.tensor(t.names[0])
                weight = Weight(view, placeholder, main, file=written, key=t.names[0])
        else:  # RAM
            if origin is None:
                source = t.tensor.detach().to(_CPU)
            elif origin.file is None:
                source = origin.value
            else:
                source = origin.materialize(_CPU)
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
        setattr(model, _DEVICE_MAP_ATTR, dict(shown_map))
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


def _main_device(device_map: Mapping[str, Placement]) -> torch.device:
    for where in device_map.values():
        if isinstance(where, torch.device) and where.type != "cpu":
            return where
    return _CPU


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str | torch.device],
    *,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Iterable[type[nn.Module] | str] | None = None,
) -> nn.Module:
    """Place ``model``'s submodules by ``device_map`` and add the hooks that run it.

    Modules mapped to a device are moved there. ``"disk"`` modules have their weights
    written to ``offload_dir`` as safetensors and mapped back copy-on-write; ``"cpu"``
    modules, when the map has a GPU, keep theirs in CPU RAM. Both run on the execution device
    (the map's first GPU, else the CPU): each forward brings their weights there and releases
    them after. Inputs go to each block's device, and the output comes back on the device of
    the input. ``model.hf_device_map`` is set to ``device_map``. Dispatching again replaces
    the hooks; :func:`remove_hooks` takes them off.

    Args:
        model: The model, with real weights (see ``load_checkpoint_and_dispatch`` to load
            into a ``meta`` model).
        device_map: ``{module name: device}``: GPU index, ``"cuda:1"``, ``"cpu"``, ``"disk"``
            or a ``torch.device``; ``""`` names the whole model.
        offload_dir: Folder for the ``"disk"`` weights (created when missing).
        offload_buffers: Also offload the buffers of offloaded modules (by default they stay
            on the execution device, as in Accelerate).
        preload_module_classes: Module classes (or names) whose instances load the weights of
            all their submodules at their own forward, for modules that use a child's weights
            without calling it. ``nn.MultiheadAttention`` always does.

    Returns:
        ``model``, dispatched in place.

    Raises:
        DeviceMapError: a bad map (from ``check_device_map``), ``"disk"`` entries with
            ``offload_dir=None``, or weights still on ``meta``.

    Example:
        >>> model = accel.dispatch_model(model, {"embed": "cpu", "layers": "disk"},
        ...                              offload_dir="offload")
        >>> model(tokens)  # layers read from disk, output on the input's device
    """
    return _dispatch_by_map(
        model,
        check_device_map(model, device_map),
        sources=None,
        offload_dir=offload_dir,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
        shown_map=device_map,
    )


def dispatch_with_sources(
    model: nn.Module,
    device_map: Mapping[str, torch.device | str],
    sources: Mapping[str, TensorSource],
    *,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Iterable[type[nn.Module] | str] | None = None,
) -> nn.Module:
    """Like :func:`dispatch_model` for a checked, normalized map, where the weights of "disk"
    modules are already on ``meta`` and ``sources`` says where each one's bytes are (by full
    parameter/buffer name). The files are mapped where they are, never copied.

    Args:
        model: The model; offloaded tensors on ``meta``, the others loaded.
        device_map: A map from ``check_device_map`` (``torch.device`` values or ``"disk"``).
        sources: By model name, the safetensors file and key holding each ``meta`` tensor
            (and the dtype to cast floating tensors to).
        offload_dir: Folder for any weight that must still be written (a real tensor
            placed on disk).
        offload_buffers: As in :func:`dispatch_model`.
        preload_module_classes: As in :func:`dispatch_model`.

    Returns:
        ``model``, dispatched in place, ``hf_device_map`` set to ``device_map``.

    Raises:
        CheckpointError: a source whose file is missing or invalid, lacks the key, or holds
            a tensor of another shape (names the key and both shapes); a source for a name
            the model does not have.
        DeviceMapError: a ``meta`` tensor with no source.

    Example:
        >>> src = TensorSource(Path("model.safetensors"), "fc.weight")
        >>> dispatch_with_sources(model, {"": "disk"}, {"fc.weight": src})
    """
    return _dispatch_by_map(
        model,
        device_map,
        sources=sources,
        offload_dir=offload_dir,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
        shown_map=device_map,
    )


def _dispatch_by_map(
    model: nn.Module,
    device_map: Mapping[str, Placement],
    *,
    sources: Mapping[str, TensorSource] | None,
    offload_dir: str | os.PathLike[str] | None,
    offload_buffers: bool,
    preload_module_classes: Iterable[type[nn.Module] | str] | None,
    shown_map: Mapping[str, object],
) -> nn.Module:
    """Dispatch by a normalized map: offloaded modules run on its main device."""
    main = _main_device(device_map)
    return _dispatch(
        model,
        device_map,
        main=main,
        offload_cpu=main.type not in ("cpu", "mps"),
        offload_dir=offload_dir,
        sources=sources,
        offload_buffers=offload_buffers,
        preload=preload_classes(preload_module_classes),
        force_hooks=False,
        shown_map=shown_map,
    )


def _execution_device(model: nn.Module, value: torch.device | str | int | None) -> torch.device:
    if value is None:
        first = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
        if first is not None and first.type != "cpu":
            return first
        from accel._state import state

        return state().device
    device = normalize_device(value)
    if not isinstance(device, torch.device) or device.type == "meta":
        raise DeviceMapError(
            f"execution_device={value!r} is not a device to run on. Pass a GPU index, "
            "'cuda:0', 'cpu' or a torch.device."
        )
    return device


def cpu_offload(
    model: nn.Module,
    *,
    execution_device: torch.device | str | int | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Iterable[type[nn.Module] | str] | None = None,
) -> nn.Module:
    """Keep every weight in CPU RAM and bring each module's weights to ``execution_device``
    for its forward only (released after). The output comes back on the input's device.

    Args:
        model: The model.
        execution_device: Where forwards run; by default the device of the model's first
            parameter when that is a GPU, else accel's device (``accel.state().device``: this
            process's GPU, or the CPU without one).
        offload_buffers: Also keep buffers in RAM (by default they go to the device).
        preload_module_classes: As in :func:`dispatch_model`.

    Returns:
        ``model``, with hooks (take them off with :func:`remove_hooks`).

    Example:
        >>> model = accel.cpu_offload(model, execution_device=0)
        >>> model(x)  # each layer's weights visit GPU 0 for its forward
    """
    device = _execution_device(model, execution_device)
    return _dispatch(
        model,
        {"": _CPU},
        main=device,
        offload_cpu=True,
        offload_dir=None,
        sources=None,
        offload_buffers=offload_buffers,
        preload=preload_classes(preload_module_classes),
        force_hooks=True,
        shown_map=None,
    )


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike[str],
    *,
    execution_device: torch.device | str | int | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Iterable[type[nn.Module] | str] | None = None,
) -> nn.Module:
    """Write every weight to ``offload_dir`` (safetensors, mapped back copy-on-write) and
    bring each module's weights to ``execution_device`` for its forward only.

    Args:
        model: The model.
        offload_dir: Folder for the weights file (created when missing).
        execution_device: As in :func:`cpu_offload`.
        offload_buffers: As in :func:`cpu_offload`.
        preload_module_classes: As in :func:`dispatch_model`.

    Returns:
        ``model``, with hooks (take them off with :func:`remove_hooks`).

    Raises:
        DeviceMapError: ``offload_dir`` is None or a file.

    Example:
        >>> model = accel.disk_offload(model, "offload")
        >>> model(x)  # weights read from offload/accel-offload.safetensors
    """
    device = _execution_device(model, execution_device)
    _offload_dir(offload_dir, "disk_offload writes every weight to offload_dir")
    return _dispatch(
        model,
        {"": DISK},
        main=device,
        offload_cpu=True,
        offload_dir=offload_dir,
        sources=None,
        offload_buffers=offload_buffers,
        preload=preload_classes(preload_module_classes),
        force_hooks=True,
        shown_map=None,
    )


def remove_hooks(model: nn.Module) -> nn.Module:
    """Take off every hook accel's dispatch functions added to ``model`` (and submodules).

    Offloaded weights come back as real CPU tensors (copies of the file for disk weights;
    tied weights stay tied), weights on devices stay where they are, ``hf_device_map`` is
    removed: the model is a plain module again.

    Args:
        model: A dispatched (or plain) model.

    Returns:
        ``model``.

    Example:
        >>> model = accel.remove_hooks(accel.disk_offload(model, "offload"))
        >>> model.state_dict()  # plain CPU tensors
    """
    for module, record in _existing(model):
        record.remove_handles()
        record.restore()
        del module.__dict__[DISPATCH_ATTR]
        module.__dict__.pop(_DEVICE_MAP_ATTR, None)
    model.__dict__.pop(_DEVICE_MAP_ATTR, None)
    return model

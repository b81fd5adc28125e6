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

import torch
from torch import nn

from accel.big_model._apply_map import (
    CPU,
    DEVICE_MAP_ATTR,
    apply_map,
    checked_offload_dir,
    existing_dispatches,
    main_device,
)
from accel.big_model._explicit_map import check_device_map, normalize_device
from accel.big_model.device_map import require_module
from accel.big_model.hooks import DISK, DISPATCH_ATTR, Placement, preload_classes
from accel.big_model.offload import TensorSource
from accel.errors import DeviceMapError

__all__ = ["cpu_offload", "disk_offload", "dispatch_model", "remove_hooks"]


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
    require_module(model, "accel.dispatch_model")
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
    main = main_device(device_map)
    return apply_map(
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
        from accel.core.state import state

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
    require_module(model, "accel.cpu_offload")
    device = _execution_device(model, execution_device)
    return apply_map(
        model,
        {"": CPU},
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
    require_module(model, "accel.disk_offload")
    device = _execution_device(model, execution_device)
    checked_offload_dir(offload_dir, "disk_offload writes every weight to offload_dir")
    return apply_map(
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
    for module, record in existing_dispatches(model):
        record.remove_handles()
        record.restore()
        del module.__dict__[DISPATCH_ATTR]
        module.__dict__.pop(DEVICE_MAP_ATTR, None)
    model.__dict__.pop(DEVICE_MAP_ATTR, None)
    return model

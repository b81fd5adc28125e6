"""Explicit device maps: every entry names a part of the model, every tensor gets a device.

A map's values are normalized to a ``torch.device`` (a GPU index ``0`` is ``cuda:0``) or
``"disk"``; :func:`check_device_map` refuses names the model does not have, ``meta`` and
tensors left without a device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from accel.errors import DeviceMapError

__all__ = ["DEVICE_MAP_CHOICES", "Placement", "check_device_map", "normalize_device"]

Placement = torch.device | str  # a torch.device, or "disk"
DEVICE_MAP_CHOICES = ("auto", "balanced", "balanced_low_0", "sequential")


def normalize_device(value: object) -> Placement:
    """A device map value as a ``torch.device`` (``0`` -> ``cuda:0``), or ``"disk"``.

    Example:
        >>> normalize_device(0), normalize_device("cpu"), normalize_device("disk")
        (device(type='cuda', index=0), device(type='cpu'), 'disk')
    """
    if isinstance(value, torch.device):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return torch.device("cuda", value)
    if value == "disk":
        return "disk"
    if isinstance(value, str):
        try:
            return torch.device(value)
        except (RuntimeError, ValueError):
            pass
    raise DeviceMapError(
        f"{value!r} is not a device for a device map; use a GPU index (0, 1, ...), a device "
        "string such as 'cpu' or 'cuda:1', a torch.device, or 'disk'."
    )


def _names(model: nn.Module) -> tuple[set[str], list[str]]:
    """Every module and tensor name, and the tensor names (tied names included)."""
    tensors = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tensors += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    modules = {n for n, _ in model.named_modules(remove_duplicate=False)}
    return modules | set(tensors), tensors


def _covered(name: str, device_map: Mapping[str, object]) -> bool:
    """Whether ``name`` or one of its enclosing modules (``""`` included) has an entry."""
    while name not in device_map:
        if not name:
            return False
        name = name.rpartition(".")[0]
    return True


def check_device_map(
    model: nn.Module, device_map: Mapping[str, int | str | torch.device]
) -> dict[str, Placement]:
    """An explicit map, checked against the model and normalized (``torch.device``/``"disk"``).

    Every entry must name a module, parameter or buffer (``""`` is the whole model), and
    every parameter and buffer must be covered by an entry (itself or an enclosing module);
    the most specific entry wins.

    Example:
        >>> check_device_map(model, {"": "cpu"})
        {'': device(type='cpu')}
    """
    if not isinstance(device_map, Mapping):
        raise DeviceMapError(
            f"device_map={device_map!r} is not a mapping or one of "
            f"{', '.join(map(repr, DEVICE_MAP_CHOICES))}."
        )
    known, tensors = _names(model)
    unknown = [k for k in device_map if not isinstance(k, str) or k not in known]
    if unknown:
        raise DeviceMapError(
            f"device_map names {unknown[:10]!r}, which the model does not have; entries are "
            "module, parameter or buffer names as in model.named_modules() ('' for the whole "
            f"model). Top-level modules: {[n for n, _ in model.named_children()][:10]!r}."
        )
    normalized = {k: normalize_device(v) for k, v in device_map.items()}
    on_meta = [k for k, v in normalized.items() if isinstance(v, torch.device) and v.type == "meta"]
    if on_meta:
        raise DeviceMapError(
            f"device_map puts {on_meta[:10]!r} on 'meta', which holds no weights; use a GPU "
            "index, 'cpu' or 'disk'."
        )
    uncovered = [t for t in tensors if not _covered(t, normalized)]
    if uncovered:
        raise DeviceMapError(
            f"device_map leaves {len(uncovered)} tensor(s) without a device, e.g. "
            f"{uncovered[:10]!r}; add entries for them or their modules (or '' for the rest)."
        )
    return normalized

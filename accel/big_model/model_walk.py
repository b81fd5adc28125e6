"""The model as the device-map planner sees it: sizes, ties, and the walk over its parts.

The planner of :mod:`accel.big_model.device_map` walks a model's direct parameters, children
and buffers in order (:func:`direct_items`, :func:`walk_order`), counts bytes under every name
(:func:`module_sizes`), keeps tied parameters together (:func:`tied_groups`), splits only
modules it may split (:func:`splittable`) and reserves room for the largest layer
(:func:`largest_layer`); :func:`merge` collapses the map it made.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeGuard, TypeVar

import torch
from torch import nn

from accel.errors import DeviceMapError

__all__ = [
    "DType", "Item", "as_dtype", "class_names", "direct_items", "inside", "largest_layer",
    "merge", "module_sizes", "splittable", "tied_groups", "walk_order",
]

DType = torch.dtype | str  # torch.float16 or "float16"/"torch.float16", as Accelerate takes
V = TypeVar("V")


def class_names(classes: Iterable[type[nn.Module] | str] | str | None) -> set[str]:
    if classes is None:
        return set()
    if isinstance(classes, (str, type)):
        classes = [classes]
    names = set()
    for item in classes:
        if isinstance(item, type):
            names.add(item.__name__)
        elif isinstance(item, str):
            names.add(item)
        else:
            raise DeviceMapError(
                f"no_split_module_classes holds {item!r}; give module classes or class names, "
                "e.g. [Block] or ['Block']."
            )
    return names


def as_dtype(dtype: DType | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise DeviceMapError(
            f"dtype={dtype!r} is not a torch dtype; give one such as torch.float16 or "
            "'bfloat16'."
        )
    return found


def module_sizes(model: nn.Module, dtype: DType | None = None) -> dict[str, int]:
    """Bytes under every module and tensor name (``""`` is the whole model).

    Each tensor counts once (tied parameters under their first name); floating tensors are
    counted in ``dtype`` when it is smaller than their own.
    """
    cast = as_dtype(dtype)
    sizes: dict[str, int] = {}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        itemsize = tensor.element_size()
        if cast is not None and tensor.is_floating_point():
            itemsize = min(itemsize, cast.itemsize)
        size = tensor.numel() * itemsize
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            sizes[prefix] = sizes.get(prefix, 0) + size
    return sizes


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one object reachable under several names.

    Each group is sorted by name, as Accelerate's ``find_tied_parameters`` gives them: when a
    pair does not fit, the first splittable partner in that order is the one split.
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [sorted(group) for group in names.values() if len(group) > 1]


Item = tuple[str, nn.Module | torch.Tensor]


def direct_items(module: nn.Module, prefix: str = "", *, buffers: bool = True) -> list[Item]:
    """A module's direct parameters, children (and buffers), with full names."""
    dot = f"{prefix}." if prefix else ""
    items: list[Item] = [(dot + n, p) for n, p in module.named_parameters(recurse=False)]
    items += [(dot + n, m) for n, m in module.named_children()]
    if buffers:
        items += [(dot + n, b) for n, b in module.named_buffers(recurse=False)]
    return items


def splittable(obj: nn.Module | torch.Tensor, no_split: set[str]) -> TypeGuard[nn.Module]:
    """Whether ``obj`` is a module with children whose class may be split."""
    return (
        isinstance(obj, nn.Module)
        and any(True for _ in obj.children())
        and type(obj).__name__ not in no_split
    )


def largest_layer(
    items: list[Item], sizes: dict[str, int], no_split: set[str]
) -> tuple[int, list[str]]:
    """The size of the largest unsplittable module among ``items``, and the names reaching it."""
    best, names = 0, []
    stack = [(n, m) for n, m in items if isinstance(m, nn.Module)]
    while stack:
        name, module = stack.pop(0)
        if splittable(module, no_split):
            stack = [(n, m) for n, m in direct_items(module, name, buffers=False)
                     if isinstance(m, nn.Module)] + stack
            continue
        size = sizes.get(name, 0)
        if size > best:
            best, names = size, [name]
        elif size == best:
            names.append(name)
    return best, names


def inside(name: str, prefix: str) -> bool:
    """Whether ``name`` is ``prefix`` or a name under it."""
    return (name + ".").startswith(prefix + ".")


def walk_order(model: nn.Module) -> dict[str, int]:
    """Every module and tensor name at its place in the planning walk (module order)."""
    order: dict[str, int] = {"": 0}
    stack: list[Item] = list(reversed(direct_items(model)))
    while stack:
        name, obj = stack.pop()
        order.setdefault(name, len(order))
        if isinstance(obj, nn.Module):
            stack.extend(reversed(direct_items(obj, name)))
    return order


def merge(device_map: dict[str, V], prefix: str = "") -> dict[str, V]:
    """Collapse every module whose entries all share one device into one entry, recursively."""
    under = [k for k in device_map if not prefix or inside(k, prefix)]
    values = {device_map[k] for k in under}
    if len(values) == 1 and len(under) > 1:
        value = device_map[under[0]]
        for k in under:
            del device_map[k]
        device_map[prefix] = value
        return device_map
    depth = len(prefix.split(".")) + 1 if prefix else 1
    children = {".".join(k.split(".")[:depth]) for k in under if len(k) > len(prefix)}
    for child in sorted(children):
        merge(device_map, child)
    return device_map

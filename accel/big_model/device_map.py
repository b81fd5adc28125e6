"""Device maps: place whole submodules on GPUs, ``"cpu"`` and ``"disk"`` within budgets.

The planner follows Accelerate's ``infer_auto_device_map`` so that maps ported from it come
out the same: walk the model's direct parameters, children and buffers in order and fill the
devices one after the other (GPUs by index, then ``"cpu"``, then ``"disk"``). A module that
does not fit is replaced by its direct parameters, children and buffers, unless its class is
in ``no_split_module_classes`` or it has no children; then it goes to the next device.
Parameters tied across modules travel together. The main devices (the first GPU and the CPU,
or the CPU alone) keep room for the largest remaining layer, which offloaded layers are
brought into for their forward.

One deliberate difference: when a module is split, its direct buffers are placed too
(Accelerate drops them, so its own ``check_device_map`` then refuses the map it made).

The model's sizes and structure come from :mod:`accel.big_model.model_walk`; explicit maps
are checked by :mod:`accel.big_model._explicit_map`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from accel.big_model._explicit_map import (
    DEVICE_MAP_CHOICES,
    Placement,
    check_device_map,
)
from accel.big_model.model_walk import (
    DType,
    Item,
    class_names,
    direct_items,
    inside,
    largest_layer,
    merge,
    module_sizes,
    splittable,
    tied_groups,
    walk_order,
)
from accel.core.sizes import parse_size
from accel.errors import ArgumentTypeError, DeviceMapError
from accel.parallel.blocks import declared_blocks

__all__ = ["get_balanced_memory", "infer_auto_device_map"]

DeviceKey = int | str  # a GPU index, "cpu" or "disk"
MaxMemory = Mapping[Any, int | float | str]  # device key -> bytes or a size string
_RAM_SHARE = 0.9  # default "cpu" budget: this share of the available RAM


def _budget_key(key: object) -> DeviceKey:
    if isinstance(key, torch.device) and key.type in ("cuda", "cpu"):
        key = str(key) if key.type == "cpu" else key.index
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if key in ("cpu", "disk"):
        return str(key)
    if isinstance(key, str):
        text = key.removeprefix("cuda:")
        if text.isdigit():
            return int(text)
    raise DeviceMapError(
        f"max_memory has the key {key!r}; keys are GPU indices (0, 1, ... or 'cuda:0'), "
        "'cpu' and 'disk', e.g. max_memory={0: '10GiB', 'cpu': '30GiB'}."
    )


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def parse_max_memory(max_memory: MaxMemory | None) -> dict[DeviceKey, int]:
    """Budgets in bytes, GPUs in index order, then ``"cpu"``, then ``"disk"``.

    ``None`` means every visible GPU's free memory and 90% of the available RAM. A given
    mapping is taken as it is (devices it leaves out get nothing), as in Accelerate.

    Example:
        >>> parse_max_memory({"cpu": "200MB", 0: "1GiB"})
        {0: 1073741824, 'cpu': 200000000}
    """
    if max_memory is None:
        budgets: dict[DeviceKey, int] = {}
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                budgets[index] = int(torch.cuda.mem_get_info(index)[0])
        budgets["cpu"] = int(_available_ram() * _RAM_SHARE)
        return budgets
    if not isinstance(max_memory, Mapping):
        raise DeviceMapError(
            f"max_memory={max_memory!r} is not a mapping; give device -> size, e.g. "
            "{0: '10GiB', 'cpu': '30GiB'}."
        )
    parsed: dict[DeviceKey, int] = {}
    for key, value in max_memory.items():
        device = _budget_key(key)
        if isinstance(value, float) and value >= 0 and value != float("inf"):
            value = int(value)  # 2e9, or Accelerate's budgets after `*= 0.9`
        size = parse_size(value)
        if size is None:
            raise DeviceMapError(
                f"max_memory[{key!r}]={value!r} is not a size; give bytes (an int >= 0) or a "
                "string such as '200MB', '10GiB' or '1.5GB' (units B, KB, MB, GB, TB, KiB, "
                "MiB, GiB, TiB)."
            )
        parsed[device] = size
    gpus = sorted(k for k in parsed if isinstance(k, int))
    return {k: parsed[k] for k in [*gpus, "cpu", "disk"] if k in parsed}


def require_module(model: object, op: str) -> None:
    """Refuse a ``model`` that is not a ``torch.nn.Module`` (the big-model entry points).

    Example:
        >>> require_module(nn.Linear(2, 2), "accel.dispatch_model")
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"{op}() takes a torch.nn.Module, got {type(model).__name__} {model!r:.60}. "
            f"Pass the model, e.g. `{op}(model, ...)`."
        )


def infer_auto_device_map(
    model: nn.Module,
    *,
    max_memory: MaxMemory | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | str | None = None,
    dtype: DType | None = None,
) -> dict[str, DeviceKey]:
    """Plan where each submodule goes: GPUs in order, then ``"cpu"``, then ``"disk"``.

    Works on a model built with ``init_empty_weights`` (only shapes and dtypes are read).
    Modules are split into their children only when they do not fit and their class is not
    in ``no_split_module_classes``; tied parameters stay on one device; the first GPU and the
    CPU keep room for the largest layer that offloaded modules are brought into.

    Args:
        model: the model to place.
        max_memory: bytes or size strings per device (``{0: "10GiB", "cpu": "30GiB"}``);
            default every GPU's free memory and 90% of the available RAM. ``"disk"`` is
            always available after the given devices.
        no_split_module_classes: classes (or class names) never split across devices, such
            as transformer blocks with residual connections; default: the blocks the model
            declares (transformers' ``_no_split_modules``), ``[]`` for none.
        dtype: the dtype floating weights will be loaded in (sizes are counted in it).

    Returns:
        Module (or parameter) names mapped to a GPU index, ``"cpu"`` or ``"disk"``, merged so
        that a module whose parts share a device is one entry (``{"": "cpu"}`` when all fit).

    Raises:
        DeviceMapError: a bad ``max_memory`` key or size, or a bad class list.

    Example:
        >>> with accel.init_empty_weights():
        ...     model = Net()
        >>> accel.infer_auto_device_map(
        ...     model, max_memory={"cpu": "1GB"}, no_split_module_classes=[Block])
        {'embed': 'cpu', 'blocks.0': 'cpu', 'blocks.1': 'disk', 'head': 'disk'}
    """
    require_module(model, "accel.infer_auto_device_map")
    budgets = parse_max_memory(max_memory)
    no_split = class_names(
        declared_blocks(model) if no_split_module_classes is None else no_split_module_classes
    )
    devices: list[DeviceKey] = [*budgets, *([] if "disk" in budgets else ["disk"])]
    gpus = [d for d in devices if isinstance(d, int)]
    main = {gpus[0], "cpu"} if gpus else {"cpu"}
    sizes = module_sizes(model, dtype)
    ties = tied_groups(model)

    queue = direct_items(model)
    used = dict.fromkeys(devices, 0)
    placed: dict[str, DeviceKey] = {}
    current = 0
    largest, largest_names = largest_layer(queue, sizes, no_split)
    while queue:
        name, obj = queue.pop(0)
        largest_names = [n for n in largest_names if not inside(n, name)]
        if not largest_names:
            largest, largest_names = largest_layer(queue, sizes, no_split)
        size = sizes.get(name, 0)
        # tied parameters with one name inside this entry and another outside it
        outside = [n for group in ties if any(inside(m, name) for m in group)
                   and not all(inside(m, name) for m in group)
                   for n in group if not inside(n, name)]
        partners: list[Item] = []
        with_ties = size
        for tied in outside:
            partner = next((item for item in queue if inside(tied, item[0])), None)
            if partner is None:  # already placed
                continue
            with_ties -= sizes.get(tied, 0)  # counted once, here or in the partner
            if all(p[0] != partner[0] for p in partners):  # a partner holding 2 tied names
                partners.append(partner)  # counts once (Accelerate counts it twice)
                with_ties += sizes.get(partner[0], 0)
        device = devices[current]
        limit: int | None = None if device == "disk" else budgets[device]
        reserved = 0
        if device in main and limit is not None:
            limit -= largest
            reserved = largest
        if limit is None or used[device] + with_ties <= limit:
            used[device] += with_ties
            placed[name] = device
            for partner_name, _ in partners:
                queue = [item for item in queue if item[0] != partner_name]
                placed[partner_name] = device
            continue
        if partners and used[device] + size <= limit:
            split = next(((n, m) for n, m in partners if splittable(m, no_split)), None)
            if split is not None:
                at = next(i for i, item in enumerate(queue) if item[0] == split[0])
                parts = direct_items(split[1], split[0])
                queue = [(name, obj), *queue[:at], *parts, *queue[at + 1:]]
                largest, largest_names = largest_layer(queue, sizes, no_split)
                continue
        if used[device] + size >= limit and splittable(obj, no_split):
            queue = [*direct_items(obj, name), *queue]
            largest, largest_names = largest_layer(queue, sizes, no_split)
            continue
        used[device] += reserved
        current += 1
        queue.insert(0, (name, obj))
    merged = merge(placed)
    order = walk_order(model)
    return dict(sorted(merged.items(), key=lambda item: order.get(item[0], len(order))))


def get_balanced_memory(
    model: nn.Module,
    *,
    max_memory: MaxMemory | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | str | None = None,
    dtype: DType | None = None,
    low_zero: bool = False,
) -> dict[DeviceKey, int]:
    """Budgets that spread the model evenly over the GPUs (for ``infer_auto_device_map``).

    Each GPU but the last gets an equal share of the model plus a margin (the larger of the
    biggest ``no_split_module_classes`` block and the mean layer, times 1.25); the last keeps
    its whole budget. With one GPU and no ``max_memory``, 90% of its free memory; with none,
    the budgets unchanged. ``low_zero`` keeps GPU 0 as empty as possible.

    Example:
        >>> accel.get_balanced_memory(model, max_memory={0: "8GiB", 1: "8GiB", "cpu": "32GiB"})
        {0: 2684354560, 1: 8589934592, 'cpu': 32000000000}
    """
    require_module(model, "accel.get_balanced_memory")
    budgets = parse_max_memory(max_memory)
    gpus = [k for k, v in budgets.items() if isinstance(k, int) and v > 0]
    if not gpus:
        return budgets
    if len(gpus) == 1:
        if max_memory is None:
            budgets[gpus[0]] = int(budgets[gpus[0]] * 0.9)
        return budgets
    sizes = module_sizes(model, dtype)
    total = sizes.get("", 0)
    per_gpu = total // (len(gpus) - 1 if low_zero else len(gpus))
    no_split = class_names(
        declared_blocks(model) if no_split_module_classes is None else no_split_module_classes
    )
    block = 0
    if no_split:
        seen: dict[str, int] = {}
        for name, module in model.named_modules():
            cls = type(module).__name__
            if name and cls in no_split and cls not in seen:
                seen[cls] = sizes.get(name, 0)
        block = max(seen.values(), default=0)
    # leaves of the size table are tensors; once removed, the leaves are the final modules
    tensors = {n for n, _ in [*model.named_parameters(), *model.named_buffers()]}
    modules = [n for n in sizes if n and n not in tensors]
    parents = {n.rpartition(".")[0] for n in modules if "." in n}
    final = [n for n in modules if n not in parents]
    mean = sum(sizes[n] for n in final) // max(len(final), 1)
    per_gpu += int(1.25 * max(block, mean))
    for index in gpus[:-1]:
        if not (low_zero and index == gpus[0]):
            budgets[index] = min(per_gpu, budgets[index])
    if low_zero:  # the first GPU takes only what the others cannot
        first = gpus[0]
        budgets[first] = min(max(0, total - sum(budgets[i] for i in gpus[1:])), budgets[first])
    return budgets


def resolve_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, int | str | torch.device],
    *,
    max_memory: MaxMemory | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | str | None = None,
    dtype: DType | None = None,
) -> dict[str, Placement]:
    """``"auto"``/``"balanced"``/``"balanced_low_0"`` (even GPU budgets), ``"sequential"``
    (fill devices in order) or an explicit map -> a checked, normalized map.

    Example:
        >>> resolve_device_map(model, "sequential", max_memory={"cpu": "1GB"})
        {'': device(type='cpu')}
    """
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAP_CHOICES:
            choices = ", ".join(map(repr, DEVICE_MAP_CHOICES))
            raise DeviceMapError(
                f"device_map={device_map!r} is not a choice; use one of "
                f"{choices} or a dict of module name -> device."
            )
        if device_map != "sequential":
            max_memory = get_balanced_memory(
                model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
                dtype=dtype, low_zero=device_map == "balanced_low_0",
            )
        device_map = infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=no_split_module_classes,
            dtype=dtype,
        )
    return check_device_map(model, device_map)

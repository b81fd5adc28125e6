"""``accel estimate-memory`` and :func:`estimate_memory`: what a model needs, per process.

The model is built on the meta device (:mod:`accel.cli.model_source`), so nothing is
allocated and nothing is downloaded; the figures come from its parameters' and buffers' shapes.
For each dtype asked for:

* **inference**: the weights and buffers in that dtype (one copy of the model);
* **largest layer**: the largest unit the device-map planner never splits (the model's
  declared blocks, transformers' ``_no_split_modules``, else leaf modules): what one device
  must hold at least;
* **training, per process**, the way accel trains: floating parameters, their gradients and
  the optimizer states stay fp32 (under ``mixed_precision="bf16"``/``"fp16"`` the parameters
  are the fp32 master copy, and the forward computes with a bf16/fp16 *compute copy*: the
  weights autocast casts, held until the backward has used them, or under FSDP the
  all-gathered units). FSDP divides parameters, gradients and optimizer states by the number
  of processes (rank 0's share, the largest: each parameter is split along its first
  dimension); DDP on several processes adds its gradient buckets (one more gradient-sized
  buffer). Activations, temporary buffers and the CUDA context are not counted: they depend
  on the batch, the sequence length and the kernels.
* **device map** (with ``max_memory``): where :func:`accel.infer_auto_device_map` would place
  the model in that dtype.

Tensor-parallel layouts (``tp_size``) are not estimated yet: only the data-parallel split.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from accel.cli.model_source import ModelSource, build_model
from accel.errors import ConfigError

__all__ = ["DTYPES", "OPTIMIZERS", "STRATEGIES", "estimate_memory", "parse_dtype"]

DTYPES: Mapping[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
"""The dtype names accepted (fp32 is training without mixed precision)."""
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
OPTIMIZERS: Mapping[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}
"""Optimizer -> fp32 states per parameter element (Adam's two moments; SGD's momentum)."""
_STEP_BYTES = {"adamw": 4, "adam": 4}  # torch keeps a float32 step tensor per parameter
STRATEGIES = ("none", "ddp", "fsdp")
_FP32 = 4


def parse_dtype(name: object) -> torch.dtype:
    """The dtype of a name among :data:`DTYPES` (any case).

    Raises:
        ConfigError: an unknown name.

    Example:
        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    found = DTYPES.get(name.strip().lower()) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(
            f"dtype {name!r} is not one accel estimates; give one of "
            f"{sorted(set(_SHORT.values()))} (or {sorted(k for k in DTYPES if len(k) > 4)})."
        )
    return found


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _share(shape: Sequence[int], parts: int) -> int:
    """Elements rank 0 holds of a tensor split along its first dimension into ``parts``."""
    if parts <= 1 or not shape:
        return _numel(shape)
    return math.ceil(shape[0] / parts) * _numel(shape[1:])


def _size(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of ``tensor`` with floating values in ``dtype`` (others keep their own)."""
    itemsize = dtype.itemsize if tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * itemsize


def _module_sizes(model: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            sizes[prefix] = sizes.get(prefix, 0) + _size(tensor, dtype)
    return sizes


def _largest_layer(model: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    from accel.big_model.model_walk import direct_items, largest_layer
    from accel.parallel.blocks import declared_blocks

    sizes = _module_sizes(model, dtype)
    size, names = largest_layer(direct_items(model), sizes, set(declared_blocks(model)))
    if not names:  # no submodule: the model is one layer
        return {"name": "", "bytes": sizes.get("", 0)}
    return {"name": names[0], "bytes": size}


def _fsdp_units(model: nn.Module) -> tuple[list[nn.Parameter], list[list[nn.Parameter]]]:
    """The root unit's parameters and each block's (FSDP's default ``shard_modules``)."""
    from accel.parallel.fsdp import default_shard_modules

    taken: set[int] = set()
    blocks: list[list[nn.Parameter]] = []
    for block in reversed(default_shard_modules(model)):  # deepest first, as fully_shard runs
        own = [p for p in block.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        if own:
            blocks.append(own)
    root = [p for p in model.parameters() if id(p) not in taken]
    return root, blocks


def _compute_bytes(params: Iterable[nn.Parameter], dtype: torch.dtype) -> int:
    return sum(_size(p, dtype) for p in params)


def _training(
    model: nn.Module, dtype: torch.dtype, world_size: int, strategy: str, optimizer: str
) -> dict[str, int]:
    sharded = strategy == "fsdp" and world_size > 1
    parts = world_size if sharded else 1
    mixed = dtype != torch.float32
    params = list(model.parameters())

    def stored(p: nn.Parameter) -> int:  # floating parameters train in fp32
        return _share(p.shape, parts) * (_FP32 if p.is_floating_point() else p.element_size())

    trainable = [p for p in params if p.requires_grad and p.is_floating_point()]
    weights = sum(stored(p) for p in params)
    gradients = sum(stored(p) for p in trainable)
    states = OPTIMIZERS[optimizer] * gradients + _STEP_BYTES.get(optimizer, 0) * len(trainable)
    if sharded:  # the unsharded units in the compute dtype: the root, a block and the next
        root, blocks = _fsdp_units(model)
        block_sizes = sorted((_compute_bytes(b, dtype) for b in blocks), reverse=True)
        compute = _compute_bytes(root, dtype) + sum(block_sizes[:1]) * min(2, len(block_sizes))
    else:  # autocast's cast of the weights, held until the backward has used them
        compute = _compute_bytes(params, dtype) if mixed else 0
    buckets = gradients if strategy == "ddp" and world_size > 1 else 0
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    items = {
        "weights": weights, "compute_copy": compute, "gradients": gradients,
        "optimizer_states": states, "ddp_buckets": buckets, "buffers": buffers,
    }
    return {**items, "total": sum(items.values())}


def _check(world_size: object, strategy: object, optimizer: object) -> tuple[int, str, str]:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(
            f"world_size={world_size!r} is invalid; it must be a whole number >= 1 (the number "
            "of processes), e.g. `world_size=8`."
        )
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"strategy={strategy!r} is invalid; it must be one of {list(STRATEGIES)}, e.g. "
            "`strategy='fsdp'`. (Tensor parallelism is not supported yet.)"
        )
    if optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer={optimizer!r} is invalid; it must be one of {list(OPTIMIZERS)} "
            "(sgd: without momentum, no state), e.g. `optimizer='adamw'`."
        )
    return world_size, str(strategy), str(optimizer)


def estimate_memory(
    model: ModelSource,
    *,
    dtypes: Iterable[str | torch.dtype] = ("fp32", "bf16"),
    world_size: int = 1,
    strategy: str = "ddp",
    optimizer: str = "adamw",
    max_memory: Mapping[Any, int | float | str] | None = None,
) -> dict[str, Any]:
    """Estimate the memory ``model`` needs to train (per process) and to run, per dtype.

    Args:
        model: a module (real or built under :func:`accel.init_empty_weights`), a transformers
            config (object, ``config.json`` or a directory holding one: built on the meta
            device, nothing downloaded) or ``"module:callable"`` returning the module.
        dtypes: the compute dtypes to estimate: ``"fp32"`` (no mixed precision), ``"bf16"``,
            ``"fp16"`` (accel's mixed precision: fp32 master weights, a compute copy).
        world_size: the number of processes.
        strategy: ``"ddp"`` (a full copy per process), ``"fsdp"`` (parameters, gradients and
            optimizer states split over the processes) or ``"none"`` (one process).
        optimizer: ``"adamw"``/``"adam"`` (two fp32 states and a step per parameter),
            ``"sgd"`` (none) or ``"sgd-momentum"`` (one).
        max_memory: a budget per device (``{0: "10GiB", "cpu": "30GiB"}``); when given, each
            dtype's entry holds the :func:`accel.infer_auto_device_map` placement.

    Returns:
        A JSON-ready dict: the model, its parameter count, the options, and under
        ``"estimates"`` one entry per dtype with ``largest_layer`` (``name``, ``bytes``),
        ``inference_bytes``, ``training`` (bytes per process: ``weights``, ``compute_copy``,
        ``gradients``, ``optimizer_states``, ``ddp_buckets``, ``buffers``, ``total``) and
        ``device_map``.

    Raises:
        ConfigError: an unknown dtype, strategy or optimizer, a bad world size, or a model
            source that cannot be built.
        DeviceMapError: a bad ``max_memory``.

    Example:
        >>> report = accel.estimate_memory("gpt2/config.json", dtypes=["bf16"], world_size=8,
        ...                                strategy="fsdp")  # GPT-2 small's config
        >>> report["parameters"], report["estimates"][0]["training"]["total"]
        (124439808, 356013136)
    """
    world_size, strategy, optimizer = _check(world_size, strategy, optimizer)
    chosen = [d if isinstance(d, torch.dtype) else parse_dtype(d) for d in dtypes]
    if not chosen or any(d not in _SHORT for d in chosen):
        raise ConfigError(
            f"dtypes={list(dtypes)!r} is invalid; give at least one of "
            f"{sorted(set(_SHORT.values()))}, e.g. `dtypes=['fp32', 'bf16']`."
        )
    if strategy == "none" and world_size > 1:
        strategy = "ddp"
    built, where = build_model(model)
    from accel.big_model.device_map import parse_max_memory

    budgets = None if max_memory is None else parse_max_memory(max_memory)
    params = list(built.parameters())
    estimates = []
    for dtype in dict.fromkeys(chosen):
        entry: dict[str, Any] = {
            "dtype": _SHORT[dtype],
            "mixed_precision": "no" if dtype == torch.float32 else _SHORT[dtype],
            "largest_layer": _largest_layer(built, dtype),
            "inference_bytes": sum(_size(t, dtype) for t in [*params, *built.buffers()]),
            "training": _training(built, dtype, world_size, strategy, optimizer),
            "device_map": None,
        }
        if budgets is not None:
            from accel.big_model import infer_auto_device_map

            placed = infer_auto_device_map(built, max_memory=budgets, dtype=dtype)
            entry["device_map"] = {name: device for name, device in placed.items()}
        estimates.append(entry)
    return {
        "model": type(built).__name__,
        "source": where,
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "world_size": world_size,
        "strategy": strategy,
        "optimizer": optimizer,
        "max_memory": None if budgets is None else {str(k): v for k, v in budgets.items()},
        "estimates": estimates,
    }


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{size} B"  # unreachable


_ROWS = (
    ("training / process", "total"),
    ("  weights (fp32)", "weights"),
    ("  compute copy", "compute_copy"),
    ("  gradients (fp32)", "gradients"),
    ("  optimizer states", "optimizer_states"),
    ("  DDP buckets", "ddp_buckets"),
    ("  buffers", "buffers"),
)


def format_estimate(report: Mapping[str, Any]) -> str:
    """The text ``accel estimate-memory`` prints: one column per dtype.

    Example:
        >>> print(format_estimate(estimate_memory(model)))  # doctest: +SKIP
    """
    entries = report["estimates"]
    processes = f"{report['world_size']} process{'es' if report['world_size'] > 1 else ''}"
    lines = [
        f"{report['model']} from {report['source']} (built on the meta device)",
        f"{report['parameters']:,} parameters ({report['trainable_parameters']:,} trainable); "
        f"{report['strategy']} on {processes}, {report['optimizer']}",
        "",
    ]
    head = ["", *(f"{e['dtype']}" + (" (mixed)" if e["mixed_precision"] != "no" else "")
                  for e in entries)]
    rows = [head, ["inference", *(_human(e["inference_bytes"]) for e in entries)],
            ["largest layer", *(_human(e["largest_layer"]["bytes"]) for e in entries)]]
    rows += [[label, *(_human(e["training"][key]) for e in entries)] for label, key in _ROWS]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
    layer = entries[0]["largest_layer"]["name"] or "(the whole model)"
    lines += [
        "",
        f"largest layer: {layer}",
        "training keeps fp32 parameters (the master copy under mixed precision), gradients and "
        "optimizer states; the compute copy is what the forward casts (DDP) or all-gathers "
        "(FSDP). Activations are not counted.",
    ]
    for entry in entries:
        if entry["device_map"] is not None:
            lines.append(f"device map in {entry['dtype']} for {report['max_memory']}: "
                         f"{entry['device_map']}")
    return "\n".join(lines)

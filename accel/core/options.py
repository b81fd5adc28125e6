"""The keyword options ``distributed()`` takes beyond its named ones (DDP, FSDP, model and fp8
options), checked once where they are given, and the block choice of activation checkpointing
and regional compilation.

The names are defined in :mod:`accel.core.settings`; the engines that use the options
(:mod:`accel.parallel.ddp`, :mod:`accel.parallel.fsdp`, :mod:`accel.parallel.blockwise`) read
them from ``accel.state().options``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from accel.core.settings import (
    DDP_HOOK_KEYS,
    DDP_KEYWORDS,
    FP8_RECIPES,
    FSDP_KEYS,
    MODEL_KEYS,
    PRECISION_CODE_KEYS,
    did_you_mean,
)
from accel.errors import ConfigError

__all__ = [
    "BLOCK_EXAMPLES",
    "BlockChoice",
    "BlockSpec",
    "blocks_option",
    "check_options",
    "fp8_filter_option",
    "fp8_recipe_option",
]

BlockSpec = type[nn.Module] | str
BlockChoice = bool | tuple[BlockSpec, ...]
"""``False`` (off), ``True`` (the default blocks) or the classes / class names chosen."""

# an example of each block option, for messages
BLOCK_EXAMPLES = {
    "activation_checkpointing": "activation_checkpointing=MyBlock",
    "compile['regional']": "compile={'regional': MyBlock}",
}


def blocks_option(value: object, key: str, origin: str) -> BlockChoice:
    """Check an ``activation_checkpointing`` (or ``compile={"regional": ...}``) value.

    Args:
        value: ``True``/``False``/``None``, an ``nn.Module`` subclass, a class name (several
            separated by commas, as the config file and ``ACCEL_*`` variables give them), or
            an iterable of classes and names.
        key: the option's name, for the message.
        origin: where it came from, for the message.

    Returns:
        ``False``, ``True`` or the classes and names as a tuple.

    Raises:
        ConfigError: any other value, or an empty list; the message names the value.

    Example:
        >>> blocks_option("GPT2Block, MLP", "activation_checkpointing", "accel.prepare_model")
        ('GPT2Block', 'MLP')
    """
    if value is None or value is False:
        return False
    if value is True:
        return True
    items: list[object]
    if isinstance(value, str):
        items = [name.strip() for name in value.split(",")]
    elif isinstance(value, type):
        items = [value]
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        items = [value]
    for item in items:
        if isinstance(item, str) and item.isidentifier():
            continue
        if isinstance(item, type) and issubclass(item, nn.Module):
            continue
        raise ConfigError(
            f"{origin}: {key}={value!r} is invalid: {item!r} is neither an nn.Module subclass "
            "nor a class name. Pass True (the model's blocks, as FSDP shards them), a block "
            f"class, its name, or a list of them, e.g. `accel.prepare_model(model, "
            f"{BLOCK_EXAMPLES[key]})`."
        )
    if not items:
        raise ConfigError(
            f"{origin}: {key}={value!r} names no block. Pass True for the model's blocks or "
            f"name their class, e.g. `accel.prepare_model(model, {BLOCK_EXAMPLES[key]})`."
        )
    return tuple(items)  # type: ignore[arg-type]


def _is_float8_config(value: object) -> bool:
    """Whether ``value`` is a torchao ``Float8LinearConfig`` (torchao is not imported: a user
    who made one has loaded it)."""
    config = sys.modules.get("torchao.float8.config")
    kind = getattr(config, "Float8LinearConfig", None)
    return isinstance(kind, type) and isinstance(value, kind)


def fp8_recipe_option(value: object, origin: str) -> object:
    """Check an ``fp8_recipe`` value: a recipe name (any case) or a torchao config.

    Args:
        value: ``None`` (the default, ``"tensorwise"``), ``"tensorwise"``, ``"rowwise"`` or a
            ``torchao.float8.Float8LinearConfig``.
        origin: where it came from, for the message.

    Returns:
        The recipe name in lower case, or the config object itself.

    Raises:
        ConfigError: any other value; the message names the choices.

    Example:
        >>> fp8_recipe_option("RowWise", "accel.distributed()")
        'rowwise'
    """
    if value is None:
        return FP8_RECIPES[0]
    if isinstance(value, str) and value.strip().lower() in FP8_RECIPES:
        return value.strip().lower()
    if _is_float8_config(value):
        return value
    raise ConfigError(
        f"{origin}: fp8_recipe={value!r} is not a recipe; choose one of {list(FP8_RECIPES)} or "
        "pass a `torchao.float8.Float8LinearConfig`, e.g. "
        "`accel.distributed(mixed_precision='fp8', fp8_recipe='rowwise')`."
    )


def fp8_filter_option(value: object, origin: str) -> Any:
    """Check an ``fp8_module_filter`` value: ``None`` (accel's rule) or a callable
    ``filter(module, name) -> bool`` (``True``: convert that ``nn.Linear`` to float8).

    Raises:
        ConfigError: anything else.

    Example:
        >>> fp8_filter_option(None, "accel.distributed()") is None
        True
    """
    if value is None or callable(value):
        return value
    raise ConfigError(
        f"{origin}: fp8_module_filter={value!r} is not callable; pass a function "
        "`filter(module, name) -> bool` that returns True for the nn.Linear layers to run in "
        "fp8, e.g. `accel.distributed(mixed_precision='fp8', "
        "fp8_module_filter=lambda module, name: 'head' not in name)`."
    )


def check_options(options: Mapping[str, Any], named: Sequence[str]) -> None:
    """Refuse ``distributed()`` keywords that are neither ``named`` nor DDP, FSDP or model options
    (a typo never runs silently); check ``activation_checkpointing`` and the fp8 options'
    values at once.

    Raises:
        ConfigError: naming the keyword, the closest known one and every known option.
    """
    if not options:
        return
    extra = (*DDP_KEYWORDS, *DDP_HOOK_KEYS, *FSDP_KEYS, *MODEL_KEYS, *PRECISION_CODE_KEYS)
    for key in options:
        if key not in extra:
            raise ConfigError(
                f"accel.distributed() got an unknown option {key!r}"
                f"{did_you_mean(key, (*named, *extra))}. It takes {list(named)} and the "
                f"DDP/FSDP/model/fp8 options {list(extra)}; rename or remove it, e.g. "
                "`accel.distributed(mixed_precision='bf16', find_unused_parameters=True)`."
            )
    if "activation_checkpointing" in options:  # a bad value fails here, not at prepare time
        value = options["activation_checkpointing"]
        blocks_option(value, "activation_checkpointing", "accel.distributed()")
    if "fp8_recipe" in options:
        fp8_recipe_option(options["fp8_recipe"], "accel.distributed()")
    if "fp8_module_filter" in options:
        fp8_filter_option(options["fp8_module_filter"], "accel.distributed()")

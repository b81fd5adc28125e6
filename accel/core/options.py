"""The keyword options ``distributed()`` takes beyond its named ones (DDP, FSDP, model and fp8
options), checked once where they are given, and the block choice of activation checkpointing
and regional compilation.

The names are defined in :mod:`accel.core.settings`; the engines that use the options
(:mod:`accel.parallel.ddp`, :mod:`accel.parallel.fsdp`, :mod:`accel.parallel.blockwise`) read
them from ``accel.state().options``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from accel.core.settings import (
    CODE_VALUES,
    DDP_HOOK_KEYS,
    DDP_KEYWORDS,
    FSDP_KEYS,
    MODEL_KEYS,
    PRECISION_CODE_KEYS,
    SETTINGS,
    did_you_mean,
)
from accel.errors import ConfigError

__all__ = [
    "BLOCK_EXAMPLES",
    "BlockChoice",
    "BlockSpec",
    "block_specs",
    "blocks_option",
    "check_options",
    "code_option",
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
    return block_specs(
        value,
        comma_separated=True,
        identifiers=True,
        invalid=lambda item: (
            f"{origin}: {key}={value!r} is invalid: {item!r} is neither an nn.Module subclass "
            "nor a class name. Pass True (the model's blocks, as FSDP shards them), a block "
            f"class, its name, or a list of them, e.g. `accel.prepare_model(model, "
            f"{BLOCK_EXAMPLES[key]})`."
        ),
        empty=(
            f"{origin}: {key}={value!r} names no block. Pass True for the model's blocks or "
            f"name their class, e.g. `accel.prepare_model(model, {BLOCK_EXAMPLES[key]})`."
        ),
    )


def block_specs(
    value: object,
    *,
    comma_separated: bool,
    identifiers: bool,
    invalid: Callable[[object], str],
    empty: str,
) -> tuple[BlockSpec, ...]:
    """Check a choice of blocks: one ``nn.Module`` subclass or class name, or an iterable of them.

    The one parser of block choices, for :func:`blocks_option` (activation checkpointing,
    regional compilation) and FSDP's ``shard_modules``; their rules differ only where the
    keywords say.

    Args:
        value: A class, a name, or an iterable of classes and names.
        comma_separated: A string holds several names separated by commas (the config file's
            and ``ACCEL_*`` variables' form), each stripped; else a string is one name.
        identifiers: A name must be a Python identifier; else any non-empty string.
        invalid: The message of the error for an item that is neither, given the item.
        empty: The message of the error when ``value`` holds no item.

    Returns:
        The classes and names, in order.

    Raises:
        ConfigError: an item that is neither an ``nn.Module`` subclass nor a name (checked
            first), or no item at all.

    Example:
        >>> block_specs("GPT2Block, MLP", comma_separated=True, identifiers=True,
        ...             invalid=lambda item: f"bad {item!r}", empty="none")
        ('GPT2Block', 'MLP')
    """
    items: list[object]
    if isinstance(value, str):
        items = [name.strip() for name in value.split(",")] if comma_separated else [value]
    elif isinstance(value, type):
        items = [value]
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        items = [value]
    for item in items:
        if isinstance(item, str) and (item.isidentifier() if identifiers else item != ""):
            continue
        if isinstance(item, type) and issubclass(item, nn.Module):
            continue
        raise ConfigError(invalid(item))
    if not items:
        raise ConfigError(empty)
    return tuple(items)  # type: ignore[arg-type]


def _is_instance(value: object, type_path: str) -> bool:
    """Whether ``value`` is an instance of the class at ``type_path`` (``"module:Class"``); the
    module is not imported: a user who made one has loaded it."""
    module, _, name = type_path.partition(":")
    kind = getattr(sys.modules.get(module), name, None)
    return isinstance(kind, type) and isinstance(value, kind)


def code_option(key: str, value: object, origin: str) -> Any:
    """Check a value code gave for ``key``, as its :class:`~accel.core.settings.CodeValue` says.

    Args:
        key: a key of :data:`~accel.core.settings.CODE_VALUES` (e.g. ``"fp8_recipe"``,
            ``"fp8_module_filter"``).
        value: the value given; ``None`` is its default.
        origin: where it came from, for the message.

    Returns:
        Kind ``"instance"``: the choice in lower case (``None``: the setting's default) or the
        instance itself; kind ``"callable"``: ``None`` or the callable.

    Raises:
        ConfigError: any other value; the message names the choices and what to pass.

    Example:
        >>> code_option("fp8_recipe", "RowWise", "accel.distributed()")
        'rowwise'
    """
    code = CODE_VALUES[key]
    if code.kind == "callable":
        if value is None or callable(value):
            return value
        raise ConfigError(
            f"{origin}: {key}={value!r} is not {code.noun}; pass {code.hint}, "
            f"e.g. `{code.example}`."
        )
    spec = SETTINGS[key]
    if value is None:
        return spec.default
    if isinstance(value, str) and value.strip().lower() in spec.choices:
        return value.strip().lower()
    if _is_instance(value, code.type_path):
        return value
    raise ConfigError(
        f"{origin}: {key}={value!r} is not {code.noun}; choose one of {list(spec.choices)} or "
        f"pass {code.hint}, e.g. `{code.example}`."
    )


def check_options(options: Mapping[str, Any], named: Sequence[str]) -> None:
    """Refuse ``distributed()`` keywords that are neither ``named`` nor DDP, FSDP or model options
    (a typo never runs silently); check ``activation_checkpointing`` and the values of the
    options in :data:`~accel.core.settings.CODE_VALUES` (the precision modes') at once.

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
    for key in CODE_VALUES:  # what code may give beyond a file's values (fp8's recipe, filter)
        if key in options:
            code_option(key, options[key], "accel.distributed()")

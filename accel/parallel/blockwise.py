"""Per-block wrappers of ``prepare_model``: activation checkpointing and regional compilation.

Both act on the model's blocks: by default the ones FSDP shards one by one
(:func:`accel.parallel.fsdp.default_shard_modules`: the classes the model declares in
``_no_split_modules``, else the children of its largest ``nn.ModuleList``/``nn.Sequential``;
under ``strategy="fsdp"`` with ``shard_modules`` given, those), or the classes named.

Activation checkpointing (``prepare_model(model, activation_checkpointing=True)``) sets each
block's ``forward`` (an instance attribute, as the mixed precision wrapper does) to
:class:`CheckpointedForward`, which runs the block's own forward through torch's
:func:`torch.utils.checkpoint.checkpoint` with ``use_reentrant=False`` while the block trains:
its activations are dropped after the forward and recomputed in the backward. The block keeps
its place in the model, its class and its parameter names, so ``named_parameters``, state
dicts, optimizer state, ``tp_plan`` patterns and ``unwrap_model`` are unchanged (torch's
``checkpoint_wrapper`` module would put ``_checkpoint_wrapped_module.`` into every name below
the block). Hooks registered on the block, FSDP2's all-gather among them, run around the
checkpointed region and not again in the recompute: the layout FSDP over torch's wrapper has.

Regional compilation (``compile="regional"``) calls ``block.compile(**options)`` on each block
instead of compiling the whole model: compiled in place, so names do not change either, and
the repeated blocks share one compiled graph, which compiles far faster than the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import attrs
import torch
from torch import nn

from accel.core.once import first_time
from accel.core.options import BLOCK_EXAMPLES, BlockChoice, BlockSpec, blocks_option
from accel.core.settings import did_you_mean
from accel.errors import ConfigError

__all__ = [
    "CheckpointedForward",
    "CompilePlan",
    "block_targets",
    "checkpoint_blocks",
    "compile_blocks",
    "compile_plan",
]

# Arguments through which a block writes a key/value cache: a recompute would write it twice.
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")


def _class_names(model: nn.Module) -> list[str]:
    return sorted({type(module).__name__ for module in model.modules()})


def _outermost(model: nn.Module, chosen: set[int]) -> list[nn.Module]:
    """The chosen modules not inside another chosen one, in the model's order."""
    names = {
        id(module): name for name, module in model.named_modules() if id(module) in chosen
    }
    prefixes = tuple(name + "." for name in names.values())
    return [
        module for name, module in model.named_modules()
        if id(module) in chosen and not name.startswith(prefixes)
    ]


def block_targets(
    model: nn.Module,
    choice: BlockChoice,
    *,
    key: str,
    shard_modules: tuple[BlockSpec, ...] | None = None,
) -> list[nn.Module]:
    """The blocks ``choice`` picks in ``model``, outermost only, in the model's order.

    Args:
        model: the root module (never a block itself).
        choice: ``True`` for FSDP's blocks (``shard_modules`` when given, else the default
            ones), or classes / class names.
        key: the option's name, for the messages.
        shard_modules: FSDP's ``shard_modules`` under ``strategy="fsdp"``, else ``None``.

    Returns:
        The blocks; a block inside another chosen one is left to its parent.

    Raises:
        ConfigError: a class or name occurs nowhere in the model, or ``True`` finds no
            block (no ``_no_split_modules``, no container holding parameters).

    Example:
        >>> [type(m).__name__ for m in block_targets(net, True, key="activation_checkpointing")]
        ['Block', 'Block']
    """
    from accel.parallel.fsdp import shard_targets

    if choice is False:
        return []
    if choice is True:
        chosen = {id(module) for module in shard_targets(model, shard_modules)}
        if not chosen:
            raise ConfigError(
                f"{key}=True found no blocks in the model ({type(model).__name__!r}): it "
                "declares no _no_split_modules and has no nn.ModuleList/nn.Sequential holding "
                f"parameters. Name the block classes, e.g. `{BLOCK_EXAMPLES[key]}`; module classes "
                f"in the model: {_class_names(model)}."
            )
        return _outermost(model, chosen)
    present = [module for module in model.modules() if module is not model]
    for spec in choice:
        matches = (
            (type(module).__name__ == spec) if isinstance(spec, str) else isinstance(module, spec)
            for module in present
        )
        if not any(matches):
            shown = spec if isinstance(spec, str) else spec.__name__
            raise ConfigError(
                f"{key} names {shown!r}, which occurs nowhere below the model's root "
                f"({type(model).__name__!r}){did_you_mean(shown, _class_names(model))}. "
                f"Module classes in the model: {_class_names(model)}. Name one of them, e.g. "
                f"`accel.prepare_model(model, {BLOCK_EXAMPLES[key]})`."
            )
    classes = tuple(spec for spec in choice if isinstance(spec, type))
    names = {spec for spec in choice if isinstance(spec, str)}
    chosen = {
        id(module) for module in present
        if isinstance(module, classes) or type(module).__name__ in names
    }
    return _outermost(model, chosen)


class CheckpointedForward:
    """A block's forward run under torch's non-reentrant activation checkpointing.

    Installed by :func:`checkpoint_blocks` as the block's instance ``forward``. While the
    block trains with gradients enabled, the block's own forward (:attr:`original`) runs
    through :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``, RNG state
    preserved, so dropout recomputes the same mask); otherwise (evaluation, ``no_grad``) it
    runs as is. A key/value cache passed to a checkpointed block (transformers' decoder
    layers get ``past_key_values`` and ``use_cache``) is dropped, as transformers' own
    gradient checkpointing does: the recompute would write it a second time.

    Example:
        >>> accel.prepare_model(net, activation_checkpointing=True)
        >>> type(net.blocks[0].__dict__["forward"]).__name__
        'CheckpointedForward'
    """

    __slots__ = ("__wrapped__", "instance_attribute", "module", "original")

    def __init__(
        self, module: nn.Module, original: Callable[..., Any], *, instance_attribute: bool
    ) -> None:
        self.module = module
        self.original = original
        self.__wrapped__ = original
        self.instance_attribute = instance_attribute  # original was an instance attribute

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.module.training and torch.is_grad_enabled()):
            return self.original(*args, **kwargs)
        dropped = [
            name for name in _CACHE_ARGUMENTS if kwargs.get(name) is not None
        ]
        if dropped or kwargs.get("use_cache"):
            kwargs = {**kwargs, **dict.fromkeys(dropped)}
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            _note_cache(type(self.module).__name__, dropped)
        return torch.utils.checkpoint.checkpoint(
            partial(self.original, **kwargs), *args, use_reentrant=False
        )

    def __repr__(self) -> str:
        return f"CheckpointedForward({self.original!r})"


def _note_cache(block: str, dropped: list[str]) -> None:
    if torch.compiler.is_compiling() or not first_time((__name__, "cache dropped")):
        return
    from accel.comm.gating import get_logger

    get_logger(__name__, main_process_only=False).warning(
        "Activation checkpointing: %s got a key/value cache (%s) while training; it runs "
        "with use_cache=False and no cache, because the backward's recompute would write the "
        "cache twice (transformers' gradient checkpointing does the same). Said once per "
        "block.", block, ", ".join(dropped) or "use_cache=True",
    )


def _counts(blocks: list[nn.Module]) -> str:
    counts: dict[str, int] = {}
    for module in blocks:
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return ", ".join(f"{n} x {c}" for c, n in counts.items())


def _note(what: str, blocks: list[nn.Module]) -> None:
    from accel.comm.gating import get_logger
    from accel.core.state import state

    if state().is_main_process:
        get_logger(__name__, main_process_only=False).info(
            "%s %d blocks (%s).", what, len(blocks), _counts(blocks)
        )


def checkpoint_blocks(
    model: nn.Module, choice: BlockChoice, *, shard_modules: tuple[BlockSpec, ...] | None = None
) -> list[nn.Module]:
    """Checkpoint the activations of each block ``choice`` picks; return those blocks.

    A block already checkpointed (by an earlier call, or by transformers'
    ``gradient_checkpointing_enable()``) is left as it is.

    Raises:
        ConfigError: see :func:`block_targets`.

    Example:
        >>> len(checkpoint_blocks(net, True))
        3
    """
    blocks = block_targets(
        model, choice, key="activation_checkpointing", shard_modules=shard_modules
    )
    for block in blocks:
        current = block.__dict__.get("forward")
        if isinstance(current, CheckpointedForward) or getattr(
            block, "gradient_checkpointing", False
        ) is True:
            continue
        block.__dict__["forward"] = CheckpointedForward(
            block, block.forward, instance_attribute=current is not None
        )
    if blocks:
        _note("Activation checkpointing on", blocks)
    return blocks


@attrs.frozen
class CompilePlan:
    """What ``prepare_model(compile=...)`` compiles: the whole model or its blocks, and how.

    ``regional`` is ``False`` for the whole model, else the blocks' choice.
    """

    regional: BlockChoice
    options: Mapping[str, Any]


def compile_plan(value: object) -> CompilePlan | None:
    """Check ``prepare_model``'s ``compile`` value; ``None`` when nothing is compiled.

    ``True`` compiles the whole model, ``"regional"`` each block; a dict holds
    :func:`torch.compile` options and may hold ``"regional"`` (``True``, or the block classes
    as for ``activation_checkpointing``). ``False`` and an empty dict compile nothing.

    Raises:
        ConfigError: another value (a misspelt ``"regional"`` among them), or an invalid
            ``"regional"`` entry.

    Example:
        >>> compile_plan({"regional": True, "backend": "eager"})
        CompilePlan(regional=True, options={'backend': 'eager'})
    """
    if value is False or value is None or (isinstance(value, Mapping) and not value):
        return None
    if value is True:
        return CompilePlan(regional=False, options={})
    if value == "regional":
        return CompilePlan(regional=True, options={})
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        options = dict(value)
        regional = blocks_option(
            options.pop("regional", False), "compile['regional']", "accel.prepare_model"
        )
        return CompilePlan(regional=regional, options=options)
    hint = did_you_mean(value, ["regional"]) if isinstance(value, str) else ""
    raise ConfigError(
        f"prepare_model(compile={value!r}) is invalid{hint}: it takes True (the whole model), "
        "'regional' (each block, compiled in place), False, or a dict of torch.compile "
        "options, which may hold 'regional', e.g. `compile={'mode': 'max-autotune'}` or "
        "`compile={'regional': True, 'backend': 'aot_eager'}`."
    )


def compile_blocks(
    model: nn.Module,
    choice: BlockChoice,
    options: Mapping[str, Any],
    *,
    shard_modules: tuple[BlockSpec, ...] | None = None,
) -> list[nn.Module]:
    """Compile each block ``choice`` picks in place (``block.compile(**options)``).

    Raises:
        ConfigError: see :func:`block_targets`.

    Example:
        >>> len(compile_blocks(net, True, {"backend": "eager"}))
        3
    """
    blocks = block_targets(
        model, choice, key="compile['regional']", shard_modules=shard_modules
    )
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(**options)
    if blocks:
        _note("Regional compilation of", blocks)
    return blocks

"""Tensor parallelism: ``prepare_model(model, tp_plan=...)`` splits layers over the ``tp`` mesh dim.

A plan maps module-name patterns to styles. A pattern is a module name whose parts may be
``*`` (any one part: ``"layers.*.mlp.up_proj"``); a style is ``"colwise"``, ``"rowwise"``,
``"sequence_parallel"``, one of the names transformers models use in their own plans (mapped to
the torch style that does the same), or a torch ``ParallelStyle``. ``tp_plan="auto"`` takes the
plan a transformers model carries (``model.tp_plan``). The plan is applied with torch's
``parallelize_module`` on the mesh's ``tp`` submesh: the chosen layers' weights become DTensors
sharded over the tensor-parallel group. Weights tied across modules (an LM head sharing the
embedding) are tied again after the split when both sides are split alike.

Example:
    >>> with accel.distributed(tp_size=2):
    ...     model = accel.prepare_model(model, tp_plan={"blocks.*.up": "colwise",
    ...                                                 "blocks.*.down": "rowwise"})
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from accel.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "STYLE_NAMES",
    "apply_tensor_parallel",
    "carries_plan",
    "matching_modules",
    "model_plan",
    "note_left_whole",
    "to_style",
]

_LOG = logging.getLogger("accel")

STYLE_NAMES = (
    "colwise", "rowwise", "sequence_parallel", "colwise_gather_output", "colwise_rep",
    "rowwise_split_input", "rowwise_rep", "embedding_rowwise",
)
"""The style names a plan may use (the last five are transformers' spellings)."""


def to_style(style: object, pattern: str) -> ParallelStyle:
    """The torch ``ParallelStyle`` for a plan entry.

    Raises:
        ConfigError: a name accel cannot map to a torch style, or another kind of value.

    Example:
        >>> type(to_style("colwise", "layers.*.up")).__name__
        'ColwiseParallel'
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(style, ParallelStyle):
        return style
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "sequence_parallel":
        return SequenceParallel()
    if style in ("colwise_gather_output", "colwise_rep"):  # the output gathered in full
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())  # a full input, split here
    raise ConfigError(
        f"tp_plan[{pattern!r}] = {style!r} is not a style accel can apply; use one of "
        f"{list(STYLE_NAMES)} or a torch ParallelStyle (e.g. "
        "`torch.distributed.tensor.parallel.ColwiseParallel(use_local_output=False)`)."
    )


def model_plan(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan a transformers model carries (``tp_plan="auto"``).

    Raises:
        ConfigError: the model has no plan.

    Example:
        >>> model_plan(LlamaForCausalLM(config))["model.layers.*.mlp.up_proj"]
        'colwise'
    """
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        config = getattr(model, "config", None)
        plan = getattr(config, "base_model_tp_plan", None)
        prefix = getattr(model, "base_model_prefix", "")
        if isinstance(plan, Mapping) and prefix and hasattr(model, prefix):
            plan = {f"{prefix}.{key}": value for key, value in plan.items()}
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(
            f"tp_plan='auto': {type(model).__name__} carries no tensor-parallel plan "
            "(transformers models have one as `model.tp_plan`). Give the plan yourself, e.g. "
            "`tp_plan={'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': "
            "'rowwise'}`."
        )
    return dict(plan)


def carries_plan(model: nn.Module) -> bool:
    """Whether ``model`` carries a tensor-parallel plan of its own (``tp_plan="auto"`` works).

    Example:
        >>> carries_plan(LlamaForCausalLM(config)), carries_plan(nn.Linear(2, 2))
        (True, False)
    """
    try:
        model_plan(model)
    except ConfigError:
        return False
    return True


_SAID_WHOLE: set[str] = set()


def note_left_whole(model: nn.Module, tp: int) -> None:
    """Warn once per model class that a model without a plan is not split over ``tp`` ranks."""
    name = type(model).__name__
    if name in _SAID_WHOLE:
        return
    _SAID_WHOLE.add(name)
    _LOG.warning(
        "accel: tp_size=%d but %s has no tp_plan: it is not split, each of the %d "
        "tensor-parallel ranks computes it whole (the same result, %dx the work). Pass "
        "`prepare_model(model, tp_plan={...})` (see docs/parallelism.md).", tp, name, tp, tp
    )


def _matches(pattern: str, name: str) -> bool:
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True))


def matching_modules(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Each module name of ``model`` and the plan entry whose pattern names it (first wins).

    Raises:
        ConfigError: a pattern that names no module (a typo would otherwise split nothing).

    Example:
        >>> matching_modules(model, {"blocks.*.up": "colwise"})
        {'blocks.0.up': 'colwise', 'blocks.1.up': 'colwise'}
    """
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, Any] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(
                f"tp_plan keys are module-name patterns (strings), got {pattern!r}; e.g. "
                "`{'layers.*.mlp.up_proj': 'colwise'}`."
            )
        found = [name for name in names if _matches(pattern, name)]
        if not found:
            close = [n for n in names if n.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1]]
            raise ConfigError(
                f"tp_plan pattern {pattern!r} names no module of {type(model).__name__}"
                f"{f' (modules with that last name: {close[:3]})' if close else ''}. Patterns "
                "are full module names from `model.named_modules()`, with `*` for one part."
            )
        for name in found:
            chosen.setdefault(name, style)
    return chosen


def _tie_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """(module name, parameter name) of each parameter held by several modules."""
    where: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            place = (module_name, param_name)
            if place not in where.setdefault(id(param), []):
                where[id(param)].append(place)
    return [places for places in where.values() if len(places) > 1]


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    from torch.distributed.tensor import DTensor

    for places in groups:
        params = [model.get_submodule(m)._parameters[p] for m, p in places]
        if all(param is params[0] for param in params):
            continue
        layouts = [
            param.placements if isinstance(param, DTensor) else None for param in params
        ]
        if any(layout != layouts[0] for layout in layouts):
            named = [f"{m}.{p}" if m else p for m, p in places]
            raise ConfigError(
                f"The tied weights {named} are split differently by tp_plan ({layouts}), so "
                "they can no longer be one tensor. Give the modules that share them the same "
                "style, or untie them (e.g. `config.tie_word_embeddings=False`)."
            )
        for module_name, param_name in places[1:]:
            model.get_submodule(module_name)._parameters[param_name] = params[0]


def _check_heads(model: nn.Module, tp: int) -> None:
    """Refuse a transformers model whose attention heads do not split over ``tp`` ranks."""
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                f"tp_size={tp} does not divide {type(model).__name__}'s {key}={heads}: each "
                "tensor-parallel rank must hold whole attention heads. Choose a tp_size that "
                f"divides {heads}."
            )


def apply_tensor_parallel(model: nn.Module, tp_plan: object, mesh: Any) -> bool:
    """Split ``model``'s layers in place over the ``tp`` dim of ``mesh`` per ``tp_plan``.

    Returns ``False`` (and changes nothing) when there is no mesh or its ``tp`` dim is 1.

    Raises:
        ConfigError: a plan that is not ``"auto"`` or a mapping, a pattern that names no
            module, a style accel cannot map, tied weights split differently.

    Example:
        >>> apply_tensor_parallel(model, "auto", accel.state().mesh)
        True
    """
    if isinstance(tp_plan, str) and tp_plan == "auto":
        plan = model_plan(model)
    elif isinstance(tp_plan, Mapping):
        plan = dict(tp_plan)
    else:
        raise ConfigError(
            f"tp_plan={tp_plan!r:.80} must be 'auto' or a mapping of module-name patterns to "
            "styles, e.g. `tp_plan={'layers.*.mlp.up_proj': 'colwise'}`."
        )
    chosen = {name: to_style(style, name) for name, style in matching_modules(model, plan).items()}
    if mesh is None or mesh["tp"].size() == 1:
        _LOG.info("accel: tp_plan given but the mesh has no tensor-parallel dim (tp_size=1): "
                  "the model is not split.")
        return False
    from torch.distributed.tensor.parallel import parallelize_module

    _check_heads(model, mesh["tp"].size())
    ties = _tie_groups(model)
    parallelize_module(model, mesh["tp"], chosen)
    _retie(model, ties)
    _LOG.info("accel: tensor parallel over %d processes: %d modules split", mesh["tp"].size(),
              len(chosen))
    return True

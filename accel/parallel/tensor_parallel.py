"""Tensor parallelism: ``prepare_model(model, tp_plan=...)`` splits layers over the ``tp`` mesh dim.

A plan maps module-name patterns to styles. A pattern is a module name whose parts may be
``*`` (any one part: ``"layers.*.mlp.up_proj"``); a style is ``"colwise"``, ``"rowwise"``,
``"sequence_parallel"``, one of the names transformers models use in their own plans (mapped to
the torch style that does the same), or a torch ``ParallelStyle``. ``tp_plan="auto"`` takes the
plan a transformers model carries (``model.tp_plan``). The plan is applied with torch's
``parallelize_module`` on the mesh's ``tp`` submesh: the chosen layers' weights become DTensors
sharded over the tensor-parallel group. Weights tied across modules (an LM head sharing the
embedding) are tied again after the split when both sides are split alike.

Before anything is split, :func:`~accel.parallel.tp_plan.check_plan` checks each planned module
on every rank (:mod:`accel.parallel.tp_plan` holds the plan language and its checks).

Example:
    >>> with accel.distributed(tp_size=2):
    ...     model = accel.prepare_model(model, tp_plan={"blocks.*.up": "colwise",
    ...                                                 "blocks.*.down": "rowwise"})
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from accel.core.once import first_time
from accel.errors import ConfigError
from accel.parallel.tp_plan import check_plan, model_plan

if TYPE_CHECKING:
    pass

__all__ = [
    "apply_tensor_parallel", "carries_plan", "note_left_whole", "plan_to_apply", "split_modules",
]

_LOG = logging.getLogger("accel")

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


def note_left_whole(model: nn.Module, tp: int) -> None:
    """Warn once per model class (and block) that a model without a plan is not split over
    ``tp`` ranks."""
    name = type(model).__name__
    if not first_time((__name__, "left whole", name)):
        return
    _LOG.warning(
        "accel: tp_size=%d but %s has no tp_plan: it is not split, each of the %d "
        "tensor-parallel ranks computes it whole (the same result, %dx the work). Pass "
        "`prepare_model(model, tp_plan={...})` (see docs/parallelism.md).", tp, name, tp, tp
    )


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


Styles = Callable[[nn.Module, Mapping[str, Any]], dict[str, Any]]


def apply_tensor_parallel(
    model: nn.Module, tp_plan: object, mesh: Any, *, styles: Styles | None = None
) -> bool:
    """Split ``model``'s layers in place over the ``tp`` dim of ``mesh`` per ``tp_plan``.

    The plan is checked first (:func:`check_plan`), on one process too. Returns ``False``
    (and changes nothing) when there is no mesh or its ``tp`` dim is 1. ``styles`` (the
    precision unit's ``parallel_styles``) may swap the checked styles for its own layers'
    (fp8: torchao's float8 styles).

    Raises:
        ConfigError: a plan that is not ``"auto"`` or a mapping, a pattern that names no
            module, a style accel cannot map, a planned module the plan cannot split over
            the ``tp`` ranks (see :func:`check_plan`), tied weights split differently.

    Example:
        >>> apply_tensor_parallel(model, "auto", accel.state().mesh)
        True
    """
    tp = 1 if mesh is None else int(mesh["tp"].size())
    chosen = check_plan(model, tp_plan, tp)
    if tp == 1:
        _LOG.info("accel: tp_plan given but the mesh has no tensor-parallel dim (tp_size=1): "
                  "the model is not split.")
        return False
    split_modules(model, chosen, mesh, styles=styles)
    return True


def split_modules(
    model: nn.Module, chosen: Mapping[str, Any], mesh: Any, *, styles: Styles | None = None
) -> None:
    """Split the modules of ``chosen`` (module name -> torch style, as :func:`check_plan`
    returned it) in place over the ``tp`` dim of ``mesh`` (whose size is > 1), tied weights
    tied again. The pipeline splits each stage's share of a plan checked on the whole model.

    Raises:
        ConfigError: attention heads the ``tp`` ranks do not divide, tied weights split
            differently.

    Example:
        >>> split_modules(model, check_plan(model, "auto", 2), accel.state().mesh)
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = int(mesh["tp"].size())
    _check_heads(model, tp)
    chosen = dict(chosen)
    if styles is not None:
        chosen = styles(model, chosen)
    ties = _tie_groups(model)
    parallelize_module(model, mesh["tp"], chosen)
    _retie(model, ties)
    _LOG.info("accel: tensor parallel over %d processes: %d modules split", tp, len(chosen))


def plan_to_apply(model: nn.Module, tp_plan: object) -> object | None:
    """The tensor-parallel plan to apply: ``tp_plan`` as given; without one under a ``tp`` dim
    > 1, ``"auto"`` for a model that carries its own plan (transformers); else ``None`` (a
    model without a plan is left whole on every TP rank, said once).

    Example:
        >>> plan_to_apply(net, None) is None   # no tp dim
        True
    """
    if tp_plan is not None:
        return tp_plan
    from accel.core.state import state

    tp = state().tp_world_size
    if tp == 1:
        return None
    if not carries_plan(model):
        note_left_whole(model, tp)
        return None
    return "auto"

"""The fp8 unit: torchao's float8 training for the ``nn.Linear`` layers, bf16 around them.

``prepare_model`` asks :meth:`Float8.convert_modules` to swap the model's ``nn.Linear`` layers
for torchao's ``Float8Linear`` (``torchao.float8.convert_to_float8_training``) before any
tensor-parallel split or FSDP2 sharding: their matmuls (forward and both backward ones) run in
float8 with dynamic scales, while everything else runs under bf16 autocast, as
``mixed_precision="bf16"`` does (:class:`~accel.precision.half.BFloat16`'s autocast, forward
wrapper, FSDP policy and fp32 master weights). The recipe is ``fp8_recipe`` (``"tensorwise"``,
``"rowwise"`` or a torchao ``Float8LinearConfig``) from ``accel.state().options``. Both options
are declared in ``accel.core.settings`` (``SETTINGS["fp8_recipe"]``, its ``code=``, and
``PRECISION_CODE_OPTIONS["fp8_module_filter"]``), which ``distributed()`` checks at block entry
(``accel.core.options.code_option``, also used here); this module gives them their meaning.

Which layers run in float8 (:func:`float8_filter`): exactly ``nn.Linear`` (not subclasses),
not the model's root, with ``in_features`` and ``out_features`` multiples of 16 (what the
float8 matmul needs), and by default not the LM head: a layer that is the model's
``get_output_embeddings()``, shares its weight with an ``nn.Embedding`` or has as many outputs
as an ``nn.Embedding`` has rows (the vocabulary). ``fp8_module_filter=fn`` replaces the
default rule: ``fn(module, name)`` returns ``True`` for the layers to convert (the type and
size checks still apply).

Composition: under FSDP2 with the tensorwise recipe torchao's float8 all-gather is turned on
(``enable_fsdp_float8_all_gather``); under tensor parallelism the plan's colwise/rowwise
styles on float8 layers become torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel``
with the tensorwise recipe (torchao's styles assume it) and stay torch's own otherwise.

torchao is imported only here, when a model is prepared under fp8; without it a
:class:`~accel.errors.ConfigError` names the extra ``accel[fp8]``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, ClassVar

import attrs
from torch import nn

from accel.core.options import code_option
from accel.core.state import state
from accel.errors import ConfigError
from accel.precision.half import BFloat16

__all__ = ["Float8", "float8_config", "float8_filter", "float8_styles", "torchao_float8"]

_LOG = logging.getLogger("accel")
_ORIGIN = "accel.distributed(), ACCEL_FP8_RECIPE or the config file"

ModuleFilter = Callable[[nn.Module, str], bool]


def torchao_float8() -> ModuleType:
    """``torchao.float8``, imported on first use.

    Raises:
        ConfigError: torchao is not installed; the message names the extra ``accel[fp8]``.

    Example:
        >>> torchao_float8().convert_to_float8_training  # doctest: +SKIP
    """
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as error:
        raise ConfigError(
            "mixed_precision='fp8' trains the nn.Linear layers with torchao's float8 training, "
            f"but torchao cannot be imported ({error}). Install the extra: "
            "`pip install 'accel[fp8]'` (torchao==0.18.0), or use `mixed_precision='bf16'`."
        ) from error


def float8_config(recipe: object, *, fsdp_all_gather: bool) -> Any:
    """The torchao ``Float8LinearConfig`` of an ``fp8_recipe`` value.

    Args:
        recipe: ``"tensorwise"``, ``"rowwise"`` (torchao's recipes of those names) or a
            ``Float8LinearConfig`` (used as given).
        fsdp_all_gather: FSDP2 will shard the model: the tensorwise recipe then all-gathers
            the weights in float8 (``enable_fsdp_float8_all_gather``).

    Returns:
        A ``torchao.float8.Float8LinearConfig``.

    Raises:
        ConfigError: not a recipe; torchao missing.

    Example:
        >>> float8_config("rowwise", fsdp_all_gather=False).round_scales_to_power_of_2
        True
    """
    chosen = code_option("fp8_recipe", recipe, _ORIGIN)
    float8 = torchao_float8()
    if not isinstance(chosen, str):
        given: Any = chosen
        if given.enable_fsdp_float8_all_gather and not fsdp_all_gather:
            # its weights would be wrapper tensors outside FSDP2, with nothing to gather
            return dataclasses.replace(given, enable_fsdp_float8_all_gather=False)
        return given
    config = float8.Float8LinearConfig.from_recipe_name(chosen)
    if fsdp_all_gather and chosen == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def _is_tensorwise(config: Any) -> bool:
    """Whether a torchao config scales inputs and weights per tensor (what torchao's float8
    TP styles and float8 all-gather assume)."""
    granularity = torchao_float8().ScalingGranularity.TENSORWISE
    return bool(
        config.cast_config_input.scaling_granularity is granularity
        and config.cast_config_weight.scaling_granularity is granularity
    )


def _lm_heads(model: nn.Module) -> set[int]:
    """``id``s of the ``nn.Linear`` layers accel's default rule keeps in bf16: the output
    embeddings (a transformers model's ``get_output_embeddings()``), a layer sharing its
    weight with an ``nn.Embedding``, or one with as many outputs as an embedding has rows."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    rows = {m.num_embeddings for m in embeddings}
    tied = {id(m.weight) for m in embeddings}
    heads: set[int] = set()
    output = getattr(model, "get_output_embeddings", None)
    if callable(output):
        head = output()
        if isinstance(head, nn.Module):
            heads.add(id(head))
    for module in model.modules():
        if type(module) is nn.Linear and (
            module.out_features in rows or id(module.weight) in tied
        ):
            heads.add(id(module))
    return heads


def _runs_in_float8(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself (not a subclass) whose sizes the float8 matmul takes."""
    return (
        type(module) is nn.Linear
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def float8_filter(model: nn.Module, chosen: ModuleFilter | None = None) -> ModuleFilter:
    """The ``module_filter_fn`` accel gives torchao for ``model``.

    Args:
        model: the model about to be converted.
        chosen: the user's ``fp8_module_filter`` (replaces the LM head rule), or ``None``.

    Returns:
        ``filter(module, name) -> bool``: ``True`` for the layers to convert.

    Example:
        >>> keep = float8_filter(model)
        >>> keep(model.lm_head, "lm_head")
        False
    """
    heads = _lm_heads(model) if chosen is None else set()

    def keep(module: nn.Module, name: str) -> bool:
        if not name or not _runs_in_float8(module):
            return False  # the root stays (it is the object the user holds); sizes
        if chosen is not None:
            return bool(chosen(module, name))
        return id(module) not in heads

    return keep


def float8_styles(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` (module name -> torch ``ParallelStyle``) with torchao's float8 styles where a
    planned module is a tensorwise ``Float8Linear`` under torch's plain colwise/rowwise style.

    Example:
        >>> float8_styles(model, {"up": ColwiseParallel()})["up"]  # doctest: +SKIP
        Float8ColwiseParallel(...)
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torchao_float8()  # the extra's message when torchao is missing
    linear = importlib.import_module("torchao.float8.float8_linear").Float8Linear
    parallel = importlib.import_module("torchao.float8.float8_tensor_parallel")
    styles = {ColwiseParallel: parallel.Float8ColwiseParallel,
              RowwiseParallel: parallel.Float8RowwiseParallel}
    out = dict(plan)
    for name, style in plan.items():
        module = model.get_submodule(name)
        replacement = styles.get(type(style))
        if (replacement is None or not isinstance(module, linear)
                or not _is_tensorwise(module.config)):
            continue
        out[name] = replacement(
            input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    return out


@attrs.frozen
class Float8(BFloat16):
    """``mixed_precision="fp8"``: ``nn.Linear`` layers in torchao's float8, bf16 around them.

    Example:
        >>> with accel.distributed(mixed_precision="fp8"):
        ...     model = accel.prepare_model(Net())
        ...     type(model.fc).__name__
        'Float8Linear'
    """

    mode: ClassVar[str] = "fp8"

    def convert_modules(self, model: nn.Module, *, fsdp: bool, tensor_parallel: bool) -> None:
        """Swap ``model``'s eligible ``nn.Linear`` layers for torchao ``Float8Linear`` in place.

        The recipe and filter come from ``accel.state().options`` (``fp8_recipe``,
        ``fp8_module_filter``). A model with no eligible layer is left as it is (a
        ``UserWarning`` says it trains as bf16).

        Args:
            model: the model ``prepare_model`` was given (before TP/FSDP).
            fsdp: FSDP2 will shard it (float8 all-gather with the tensorwise recipe).
            tensor_parallel: tensor parallelism will split it (no float8 all-gather then).

        Raises:
            ConfigError: torchao is not installed, or a bad ``fp8_recipe``/
                ``fp8_module_filter``.

        Example:
            >>> Float8().convert_modules(model, fsdp=False, tensor_parallel=False)
        """
        options = state().options
        chosen = code_option("fp8_module_filter", options.get("fp8_module_filter"),
                             "accel.distributed()")
        config = float8_config(
            options.get("fp8_recipe"), fsdp_all_gather=fsdp and not tensor_parallel
        )
        if fsdp and config.enable_fsdp_float8_all_gather:
            self.upcast_master_weights(model)  # before torchao wraps the weights
        keep = float8_filter(model, chosen)
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        converted = [name for name, m in model.named_modules() if keep(m, name)]
        if not converted:
            import warnings

            warnings.warn(
                f"mixed_precision='fp8': none of {type(model).__name__}'s {len(linears)} "
                "nn.Linear layers can run in float8 (sizes must be multiples of 16; the LM head "
                "and the root are kept), so it trains as bf16. See docs/training.md#fp8.",
                UserWarning, stacklevel=4,
            )
            return
        torchao_float8().convert_to_float8_training(
            model, module_filter_fn=keep, config=config
        )
        skipped = [name or "(root)" for name in linears if name not in set(converted)]
        _LOG.info("accel: fp8: %d of %d nn.Linear layers run in float8 (kept in bf16: %s)",
                  len(converted), len(linears), skipped[:8])

    def parallel_styles(self, model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
        """torchao's float8 colwise/rowwise styles for tensorwise float8 layers
        (:func:`float8_styles`)."""
        return float8_styles(model, plan)

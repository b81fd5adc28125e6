"""Prepare a model for the run (device, mixed precision forward, DDP or FSDP2, compile) and
unwrap it.

FSDP2 (``strategy="fsdp"``, ``torch.distributed.fsdp.fully_shard``) lives in
``accel/parallel/fsdp.py`` (imported only when that strategy is used); this module dispatches to
it. Nothing else in the training path assumes DDP: accumulation, clipping and the optimizer
wrapper work on any module.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel.core.options import BlockChoice, BlockSpec, blocks_option
from accel.core.settings import STRATEGIES
from accel.core.state import state
from accel.errors import ArgumentTypeError, ConfigError
from accel.parallel.blockwise import CompilePlan, checkpoint_blocks, compile_blocks, compile_plan
from accel.parallel.ddp import DDPOptions, ddp_options, make_ddp, note_ignored
from accel.parallel.ddp_teardown import watch_reducers
from accel.parallel.fsdp_params import mark_replaced
from accel.precision.casting import prepare_forward, remove_forward
from accel.precision.registry import precision_for

__all__ = ["is_prepared", "prepare_model", "unwrap_model"]

# Attribute names kept in a module's __dict__ (written there directly: nn.Module.__setattr__
# would register a module value as a submodule, and is slower).
_PREPARED = "_accel_prepared"  # weakref to the object prepare_model returned


def is_prepared(model: nn.Module) -> bool:
    """Whether ``model`` was returned by (or given to) :func:`prepare_model`.

    Example:
        >>> is_prepared(accel.prepare_model(nn.Linear(2, 2)))
        True
    """
    return _prepared_result(model) is not None


def _prepared_result(model: nn.Module) -> nn.Module | None:
    ref = model.__dict__.get(_PREPARED)
    return ref() if ref is not None else None


def _mark(module: nn.Module, result: nn.Module) -> None:
    module.__dict__[_PREPARED] = weakref.ref(result)


def _resolve_strategy(strategy: str | None) -> str:
    chosen = state().strategy if strategy is None else strategy
    if chosen not in STRATEGIES:
        raise ConfigError(
            f"strategy={chosen!r} is not supported; choose one of {list(STRATEGIES)}, "
            "e.g. `accel.prepare_model(model, strategy='ddp')`."
        )
    return chosen


def _compiled_inner(model: nn.Module) -> nn.Module | None:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None:  # nothing was compiled in this process
        return None
    if isinstance(model, dynamo.OptimizedModule):
        inner: nn.Module = model._orig_mod
        return inner
    return None


def _wrap_ddp(module: nn.Module, device: torch.device, options: DDPOptions) -> nn.Module:
    placement: dict[str, Any] = {}
    if device.type == "cuda" and device.index is not None:
        placement = {"device_ids": [device.index], "output_device": device.index}
    watch_reducers()
    return make_ddp(module, options, placement)


def _checkpointing_choice(given: object, run_options: Mapping[str, Any]) -> BlockChoice:
    """``prepare_model``'s ``activation_checkpointing``, else the run's, checked."""
    if given is not None:
        return blocks_option(given, "activation_checkpointing", "accel.prepare_model")
    return blocks_option(
        run_options.get("activation_checkpointing"), "activation_checkpointing",
        "accel.distributed(), ACCEL_ACTIVATION_CHECKPOINTING or the config file",
    )


def _no_ddp_reason(chosen: str, world_size: int, evaluation_mode: bool, model: nn.Module) -> str:
    """Why no DDP wrapper applies, or ``""`` when one does."""
    if world_size == 1:
        return "one process"
    if chosen != "ddp":
        return f"strategy={chosen!r}"
    if evaluation_mode:
        return "evaluation_mode=True"
    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameter"
    return ""


def _plan_to_apply(model: nn.Module, tp_plan: object) -> object | None:
    """The tensor-parallel plan to apply: ``tp_plan`` as given; without one under a ``tp`` dim
    > 1, ``"auto"`` for a model that carries its own plan (transformers); else ``None`` (a
    model without a plan is left whole on every TP rank, said once)."""
    if tp_plan is not None:
        return tp_plan
    tp = state().tp_world_size
    if tp == 1:
        return None
    from accel.parallel.tensor_parallel import carries_plan, note_left_whole

    if not carries_plan(model):
        note_left_whole(model, tp)
        return None
    return "auto"


def _split_tensor_parallel(model: nn.Module, tp_plan: object, device_placement: bool) -> bool:
    """Apply ``tp_plan`` on the state's mesh; whether the model was split.

    Without a plan under a ``tp`` dim > 1, a model that carries its own plan (transformers)
    is split by it (``"auto"``); any other model is left whole on every TP rank (said once).
    """
    st = state()
    tp_plan = _plan_to_apply(model, tp_plan)
    if tp_plan is None:
        return False
    from accel.parallel.tensor_parallel import apply_tensor_parallel

    if device_placement:
        model.to(st.device)
    before = dict(model.named_parameters())
    styles = precision_for(st.mixed_precision).parallel_styles
    split = apply_tensor_parallel(model, tp_plan, st.mesh, styles=styles)
    if split:
        mark_replaced(model, before)  # an optimizer made before prepare_model is moved over
    return split


def _split_pipeline(
    model: nn.Module, chosen: str, checkpointing: BlockChoice, plan: CompilePlan | None,
    evaluation_mode: bool, device_placement: bool, tp_plan: object,
    strategy_options: dict[str, Any], pipeline: dict[str, Any],
) -> bool:
    """Split ``model`` into this rank's pipeline stages (TP inside each over the ``tp`` dim,
    then FSDP2 over the data-parallel dims, then regional compilation of its blocks); whether
    it was split (not without a ``pp`` dim)."""
    from accel.parallel.pipeline.stages import pipeline_model

    st = state()
    tp_styles = None
    if st.pp_world_size > 1:
        if plan is not None and plan.regional is False:
            raise ConfigError(
                "prepare_model(compile=True) compiles the whole model, which a pipeline never "
                "calls: torch's schedule runs each stage's module on its own, between the "
                "sends and receives of activations. Compile each stage's blocks instead: "
                "`compile='regional'` (or `compile={'regional': True, ...options}`)."
            )
        if st.cp_world_size > 1:
            raise ConfigError(
                f"Pipeline parallelism (pp_size={st.pp_world_size}) with context parallelism "
                f"(cp_size={st.cp_world_size}) is not available yet: the stages pass hidden "
                "states of whole sequences and do not split them. Use pp_size with data "
                "parallelism, or cp_size without pp_size."
            )
        if chosen == "ddp" and st.dp_world_size > 1 and strategy_options:
            note_ignored(ddp_options(st.options, strategy_options), "pipeline parallelism")
        tp_styles = _stage_tensor_plan(model, tp_plan)
    shard = None
    if st.dp_world_size > 1 and not evaluation_mode and st.pp_world_size > 1:
        from accel.parallel import fsdp

        sharding = fsdp.fsdp_options(st.options, strategy_options if chosen == "fsdp" else {})

        def shard(module: nn.Module) -> nn.Module:
            return fsdp.shard_model(module, sharding, device_placement=device_placement)

    def checkpoint(view: nn.Module) -> None:
        checkpoint_blocks(view, checkpointing)

    def compile_view(view: nn.Module) -> None:
        assert plan is not None  # set when compile_view is passed
        compile_blocks(view, plan.regional, plan.options)

    def convert(whole: nn.Module) -> None:  # fp8's layers, once the plan is checked
        _convert_modules(whole, chosen, tp_plan, evaluation_mode)

    return pipeline_model(
        model, **pipeline, device_placement=device_placement, shard=shard,
        checkpoint=None if checkpointing is False else checkpoint, checkpointing=checkpointing,
        convert=convert, tp_styles=tp_styles,
        compile_blocks=None if plan is None else compile_view,
    )


def _stage_tensor_plan(model: nn.Module, tp_plan: object) -> dict[str, Any] | None:
    """Under a ``pp`` dim: the tensor-parallel plan checked on the whole (unsplit) model,
    module name -> torch style, which each rank applies to its stages after the split;
    ``None`` when nothing is split (no ``tp`` dim, or a model without a plan of its own)."""
    st = state()
    tp_plan = _plan_to_apply(model, tp_plan)
    if tp_plan is None:
        return None
    from accel.parallel.tp_plan import check_plan

    chosen = check_plan(model, tp_plan, st.tp_world_size)
    return chosen if st.tp_world_size > 1 else None


def _convert_modules(
    model: nn.Module, chosen: str, tp_plan: object, evaluation_mode: bool
) -> None:
    """The mode's own layers (fp8: torchao's float8 ``nn.Linear``), before any split or
    sharding, told whether FSDP2 will shard the model and whether TP may split it."""
    st = state()
    tensor_parallel = st.tp_world_size > 1 and (tp_plan is not None or _carries_plan(model))
    fsdp = not evaluation_mode and st.dp_world_size > 1 and (
        chosen == "fsdp" or tensor_parallel or st.pp_world_size > 1  # stages: always FSDP2
    )
    precision_for(st.mixed_precision).convert_modules(
        model, fsdp=fsdp, tensor_parallel=tensor_parallel
    )


def _carries_plan(model: nn.Module) -> bool:
    from accel.parallel.tensor_parallel import carries_plan

    return carries_plan(model)


def prepare_model(
    model: nn.Module,
    *,
    device_placement: bool = True,
    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] | None = None,
    compile: bool | Literal["regional"] | Mapping[str, Any] = False,
    evaluation_mode: bool = False,
    activation_checkpointing: bool | BlockSpec | Iterable[BlockSpec] | None = None,
    tp_plan: str | Mapping[str, Any] | None = None,
    pp_plan: list[str] | int | Literal["auto"] | None = None,
    pp_schedule: str | None = None,
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    **strategy_options: Any,
) -> nn.Module:
    """Make ``model`` ready for the run: device, mixed precision forward, DDP or FSDP2, compile.

    In order: under ``mixed_precision="fp8"`` its eligible ``nn.Linear`` layers become
    torchao's ``Float8Linear`` (see ``docs/training.md#fp8``); the model moves to
    ``accel.state().device``; under mixed precision (bf16/fp16/fp8) its ``forward`` is
    wrapped once to run in autocast and return floating outputs as fp32
    (Accelerate's ``convert_outputs_to_fp32``); with several processes and the ``"ddp"``
    strategy it is wrapped in :class:`~torch.nn.parallel.DistributedDataParallel` (gloo on
    CPU without ``device_ids``, CUDA with ``device_ids=[device.index]``) unless
    ``evaluation_mode`` is set or it has no trainable parameter; ``compile=True`` applies
    :func:`torch.compile` last. Preparing the result (or the original module) again returns
    the same object.

    With ``strategy="fsdp"`` the model is sharded in place with FSDP2's ``fully_shard``
    instead of being wrapped in DDP (see ``docs/fsdp.md``): each block named by
    ``shard_modules`` and then the root; under mixed precision a ``MixedPrecisionPolicy``
    casts the all-gathered parameters and gradient reductions to bf16/fp16 while the sharded
    parameters stay fp32, and the autocast forward wrapper is installed as well. Prepare the
    model before creating its optimizer (or pass both to :func:`accel.prepare`): sharding
    replaces the parameters. On one process the model is not sharded (an info note says so).

    ``activation_checkpointing`` and ``compile="regional"`` act on the model's blocks (see
    ``docs/activation_checkpointing.md``): the ones FSDP shards one by one (the model's
    ``_no_split_modules``, else the children of its largest ``nn.ModuleList``/
    ``nn.Sequential``; FSDP's ``shard_modules`` when given), or the classes named. Their
    activations are recomputed in the backward with torch's non-reentrant
    ``torch.utils.checkpoint`` (before any sharding or DDP wrapper), and each is compiled in
    place with ``torch.compile`` (after FSDP sharding). Names and state dict keys do not change.

    Args:
        model: the user's module.
        device_placement: move the model to the state's device.
        strategy: ``"none"``, ``"ddp"`` or ``"fsdp"``; default ``accel.state().strategy``.
        compile: wrap the result with :func:`torch.compile`; ``"regional"`` compiles each
            block instead; a mapping is passed to it as options, e.g.
            ``{"mode": "max-autotune"}`` or ``{"backend": "eager"}``, and may hold
            ``"regional"`` (``True`` or block classes, as for ``activation_checkpointing``).
        evaluation_mode: prepare for inference only (no DDP wrapper, no FSDP sharding).
        activation_checkpointing: ``True`` (the blocks), a block class, a class name, or an
            iterable of them; default ``accel.distributed(activation_checkpointing=...)``,
            ``ACCEL_ACTIVATION_CHECKPOINTING`` or the config file, else off.
        tp_plan: tensor parallelism over the mesh's ``tp`` dim (``accel.distributed(
            tp_size=...)``): ``{module-name pattern: style}`` or ``"auto"`` (a transformers
            model's own plan), see ``docs/parallelism.md``; by default ``"auto"`` for a model
            that carries a plan, else none (the model stays whole on every TP rank). Applied
            first; then FSDP over the data-parallel dims (``dp_shard``, HSDP with
            ``dp_replicate``), or replicas kept in sync over ``dp_replicate`` (FSDP2 with a
            shard size of 1).
            Under ``accel.distributed(cp_size=...)`` a transformers model is wired for
            context parallelism next (``accel.parallel.context_parallel``): its forward
            takes the whole batch and each cp rank works on its piece of every sequence.
        pp_plan: pipeline parallelism over the mesh's ``pp`` dim (``accel.distributed(
            pp_size=...)``): the module names that start a stage (``["layers.4"]``), a number
            of stages, or ``"auto"`` (the model's blocks split evenly, embeddings with the
            first stage, norm and head with the last; the default under a ``pp`` dim). The
            model is split in place into this rank's stages; train it with
            ``accel.pipeline_step``. See ``docs/parallelism.md``.
        pp_schedule: one of torch's schedules: ``"GPipe"``, ``"1F1B"`` (default),
            ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``,
            ``"ZBVZeroBubble"``, ``"DualPipeV"``.
        microbatches: microbatches per ``pipeline_step`` (default: the number of stages).
        stages_per_rank: stages each rank runs (default 1; 2 for the interleaved and V
            schedules).
        **strategy_options: with ``strategy="fsdp"``: ``shard_modules`` (a module class, a
            class name, or an iterable of them), ``reshard_after_forward`` (default ``True``)
            and ``cpu_offload`` (default ``False``), overriding those of
            ``accel.distributed()``. Otherwise DDP options, overriding those of
            ``accel.distributed()`` and the config file key by key:
            ``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
            ``bucket_cap_mb``, ``broadcast_buffers``,
            ``comm_hook`` (``"no"``, ``"fp16"``, ``"bf16"``, ``"power_sgd"``,
            ``"batched_power_sgd"`` or a callable ``hook(state, bucket)``), ``comm_wrapper``
            (``"no"``, ``"fp16"``, ``"bf16"``), ``comm_state_option`` (PowerSGD options) and
            ``comm_state`` (the state of a callable hook). Checked on every world size;
            where no DDP wrapper applies they are ignored (said once, at debug level).

    Returns:
        The module to train with (the model itself, sharded in place under FSDP, a DDP
        wrapper, or a compiled module).

    Raises:
        ConfigError: unknown strategy, unknown DDP/FSDP option, invalid option value, a
            ``shard_modules`` or ``activation_checkpointing`` class that occurs nowhere in the
            model, or no blocks found for ``True``/``"regional"``.

    Example:
        >>> with accel.distributed(mixed_precision="bf16"):
        ...     model = accel.prepare_model(nn.Linear(4, 2))
        ...     model(torch.ones(1, 4)).dtype
        torch.float32
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"prepare_model expects a torch.nn.Module, got {type(model).__name__} "
            f"{model!r:.60}. "
            "Pass the model itself, e.g. `accel.prepare_model(model)`."
        )
    plan = compile_plan(compile)
    existing = _prepared_result(model)
    if existing is not None:
        return existing
    chosen = _resolve_strategy(strategy)
    if chosen == "deepspeed":
        from accel.parallel.deepspeed.engine import refuse

        raise refuse("accel.prepare_model(model) on its own")
    st = state()
    checkpointing = _checkpointing_choice(activation_checkpointing, st.options)
    if pp_plan is not None or st.pp_world_size > 1:
        pipelined = _split_pipeline(
            model, chosen, checkpointing, plan, evaluation_mode, device_placement, tp_plan,
            strategy_options,
            {"plan": pp_plan, "schedule": pp_schedule, "microbatches": microbatches,
             "stages_per_rank": stages_per_rank},
        )
        if pipelined:
            _mark(model, model)
            return model
    shard_modules = None
    _convert_modules(model, chosen, tp_plan, evaluation_mode)
    split = _split_tensor_parallel(model, tp_plan, device_placement)
    if st.cp_world_size > 1:  # a transformers model's attention and forward split the sequence
        from accel.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(model)
    if split and chosen != "fsdp":
        # TP weights are DTensors, which DDP cannot sync: FSDP2 keeps the data-parallel
        # replicas in sync instead (a shard size of 1 when only dp_replicate is set).
        note_ignored(ddp_options(st.options, {}), "tensor parallelism")
        group = st.dp_world_size * st.cp_world_size  # cp ranks sync like data-parallel ones
        chosen = "fsdp" if group > 1 and not evaluation_mode else "none"
        strategy_options = {}
    if chosen == "fsdp":
        from accel.parallel import fsdp  # torch.distributed.fsdp loads only for this strategy

        sharding = fsdp.fsdp_options(st.options, strategy_options)
        shard_modules = sharding.shard_modules
        if checkpointing is not False:  # before sharding: FSDP's hooks stay outside
            checkpoint_blocks(model, checkpointing, shard_modules=shard_modules)
        model = fsdp.shard_model(
            model, sharding, evaluation_mode=evaluation_mode, device_placement=device_placement
        )
    else:
        ddp = ddp_options(st.options, strategy_options)
        if checkpointing is not False:
            checkpoint_blocks(model, checkpointing)
        if device_placement:
            model = model.to(st.device)
    if plan is not None and plan.regional is not False:  # in place, after sharding
        compile_blocks(model, plan.regional, plan.options, shard_modules=shard_modules)
    prepare_forward(model)  # the mode's autocast wrapper, if it has one
    result: nn.Module = model
    if chosen != "fsdp" and not split:
        no_ddp = _no_ddp_reason(chosen, st.world_size, evaluation_mode, model)
        if no_ddp:
            note_ignored(ddp, no_ddp)
        else:
            result = _wrap_ddp(model, st.device, ddp)
    if plan is not None and plan.regional is False:
        result = torch.compile(result, **plan.options)  # type: ignore[assignment]
    _mark(model, result)
    if result is not model:
        _mark(result, result)
    return result


def unwrap_model(model: nn.Module, *, keep_fp32_wrapper: bool = True) -> nn.Module:
    """The user's module inside a prepared model (through DDP and ``torch.compile``).

    FSDP2 shards in place: the module ``prepare_model`` returned is the user's module (its
    class is now FSDP's subclass of the user's class, and its parameters are sharded), so it
    is returned as it is. ``accel.get_state_dict`` gives its full weights.

    Args:
        model: a prepared (or plain) module.
        keep_fp32_wrapper: when ``False``, also put back the module's original ``forward``
            (removing the mixed precision wrapper, in place), e.g. before exporting it.

    Returns:
        The innermost user module.

    Example:
        >>> prepared = accel.prepare_model(net)
        >>> accel.unwrap_model(prepared) is net
        True
    """
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
            continue
        inner = _compiled_inner(model)
        if inner is None and "deepspeed" in sys.modules:
            from accel.parallel.deepspeed.engine import inner_module

            inner = inner_module(model)
        if inner is None:
            break
        model = inner
    if not keep_fp32_wrapper:
        remove_forward(model)
    return model

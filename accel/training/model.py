"""Prepare a model for the run (device, mixed precision forward, the engine, compile) and
unwrap it.

The order is this module's; what each engine does to the model (DDP's wrapper, FSDP2's
sharding, DeepSpeed's refusal of a model alone) is its unit's
(``accel.parallel.engines``), and a pipelined model's stages are built by
``accel.parallel.pipeline.compose``. Nothing else in the training path assumes an engine:
accumulation, clipping and the optimizer wrapper ask the unit.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from accel.core.agreement import agree_on_settings, settings_of
from accel.core.options import BlockChoice, BlockSpec, blocks_option
from accel.core.state import state
from accel.errors import ArgumentTypeError
from accel.parallel.blockwise import compile_blocks, compile_plan
from accel.parallel.engines.base import Engine
from accel.parallel.engines.registry import ENGINES, engine_for
from accel.parallel.fsdp_params import mark_replaced
from accel.parallel.pipeline.compose import prepare_pipelined
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


def _engine(strategy: str | None) -> Engine:
    return engine_for(state().strategy if strategy is None else strategy)


def _compiled_inner(model: nn.Module) -> nn.Module | None:
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None:  # nothing was compiled in this process
        return None
    if isinstance(model, dynamo.OptimizedModule):
        inner: nn.Module = model._orig_mod
        return inner
    return None


def _checkpointing_choice(given: object, run_options: Mapping[str, Any]) -> BlockChoice:
    """``prepare_model``'s ``activation_checkpointing``, else the run's, checked."""
    if given is not None:
        return blocks_option(given, "activation_checkpointing", "accel.prepare_model")
    return blocks_option(
        run_options.get("activation_checkpointing"), "activation_checkpointing",
        "accel.distributed(), ACCEL_ACTIVATION_CHECKPOINTING or the config file",
    )


def _split_tensor_parallel(model: nn.Module, tp_plan: object, device_placement: bool) -> bool:
    """Apply ``tp_plan`` on the state's mesh; whether the model was split.

    Without a plan under a ``tp`` dim > 1, a model that carries its own plan (transformers)
    is split by it (``"auto"``); any other model is left whole on every TP rank (said once).
    """
    from accel.parallel.tensor_parallel import apply_tensor_parallel, plan_to_apply

    st = state()
    tp_plan = plan_to_apply(model, tp_plan)
    if tp_plan is None:
        return False
    if device_placement:
        model.to(st.device)
    before = dict(model.named_parameters())
    styles = precision_for(st.mixed_precision).parallel_styles
    split = apply_tensor_parallel(model, tp_plan, st.mesh, styles=styles)
    if split:
        mark_replaced(model, before)  # an optimizer made before prepare_model is moved over
    return split


def _convert_modules(
    model: nn.Module, engine: Engine, tp_plan: object, evaluation_mode: bool, *,
    stages: bool = False,
) -> None:
    """The mode's own layers (fp8: torchao's float8 ``nn.Linear``), before any split or
    sharding, told whether FSDP2 will shard the model (always pipeline ``stages``) and
    whether TP may split it."""
    from accel.parallel.tensor_parallel import carries_plan

    st = state()
    tensor_parallel = st.tp_world_size > 1 and (tp_plan is not None or carries_plan(model))
    fsdp = not evaluation_mode and st.dp_world_size > 1 and (
        engine.shards_parameters or tensor_parallel or stages
    )
    precision_for(st.mixed_precision).convert_modules(
        model, fsdp=fsdp, tensor_parallel=tensor_parallel
    )


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

    Every rank must call it (except with ``evaluation_mode=True``): the ranks first agree, with
    one small collective, on the block's settings and these arguments (plans, schedule,
    microbatches, options), see ``docs/state.md``, "Ranks that disagree".

    Raises:
        ConfigError: unknown strategy, unknown DDP/FSDP option, invalid option value, a
            ``shard_modules`` or ``activation_checkpointing`` class that occurs nowhere in the
            model, or no blocks found for ``True``/``"regional"``; the ranks passed or
            resolved different settings (on every rank, naming each one).

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
    engine = _engine(strategy)
    engine.refuse_prepare_model()
    st = state()
    checkpointing = _checkpointing_choice(activation_checkpointing, st.options)
    if not evaluation_mode:  # an evaluation copy makes no collective: one rank may make it
        agree_on_settings("accel.prepare_model()", {
            **settings_of(st), **strategy_options, "strategy": engine.name, "tp_plan": tp_plan,
            "pp_plan": pp_plan, "pp_schedule": pp_schedule, "microbatches": microbatches,
            "stages_per_rank": stages_per_rank, "compile": compile,
            "device_placement": device_placement, "model": type(model),
            "activation_checkpointing": (st.options.get("activation_checkpointing")
                                         if activation_checkpointing is None
                                         else activation_checkpointing),
        }, device=st.device)  # one collective, before any engine or stage starts

    def convert(whole: nn.Module) -> None:  # fp8's layers, once the stage plan is checked
        _convert_modules(whole, engine, tp_plan, evaluation_mode, stages=True)

    pipeline = {"plan": pp_plan, "schedule": pp_schedule, "microbatches": microbatches,
                "stages_per_rank": stages_per_rank}
    if prepare_pipelined(
        model, engine.stage_options, strategy_options, checkpointing=checkpointing, plan=plan,
        evaluation_mode=evaluation_mode, device_placement=device_placement, tp_plan=tp_plan,
        convert=convert, pipeline=pipeline,
    ):
        _mark(model, model)
        return model
    _convert_modules(model, engine, tp_plan, evaluation_mode)
    split = _split_tensor_parallel(model, tp_plan, device_placement)
    from accel.parallel.context_parallel import apply_context_parallel

    apply_context_parallel(model)  # under a cp dim: a transformers model splits its sequences
    if split:  # TP weights are DTensors: FSDP2 keeps the replicas in sync, not DDP
        synced = engine.under_tensor_parallel(st, evaluation_mode)
        if synced != engine.name:
            engine, strategy_options = engine_for(synced), {}
    placed = engine.place(
        model, st, strategy_options, checkpointing=checkpointing,
        evaluation_mode=evaluation_mode, device_placement=device_placement,
    )
    model = placed.model
    if plan is not None and plan.regional is not False:  # in place, after sharding
        compile_blocks(model, plan.regional, plan.options, shard_modules=placed.shard_modules)
    prepare_forward(model)  # the mode's autocast wrapper, if it has one
    result = model if split else engine.wrap(placed, st, evaluation_mode)
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
        inner = _compiled_inner(model)
        if inner is None:
            for unit in ENGINES.values():  # DDP's wrapper, DeepSpeed's engine
                inner = unit.inner(model)
                if inner is not None:
                    break
        if inner is None:
            break
        model = inner
    if not keep_fp32_wrapper:
        remove_forward(model)
    return model

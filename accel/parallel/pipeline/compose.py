"""What ``prepare_model`` asks of the pipeline: a pipelined block's refusals, and the other
dims each stage gets (the tensor-parallel plan checked on the whole model, FSDP2 over the
data-parallel dims, activation checkpointing, regional compilation, the precision mode's
layers), handed to :func:`~accel.parallel.pipeline.stages.pipeline_model`.

Example:
    >>> with accel.distributed(pp_size=2):
    ...     prepare_pipelined(model, engine_for("ddp").stage_options, {}, checkpointing=False,
    ...         plan=None,
    ...         evaluation_mode=False, device_placement=True, tp_plan=None,
    ...         convert=lambda whole: None, pipeline={"plan": "auto", "schedule": None,
    ...         "microbatches": None, "stages_per_rank": None})
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from accel.core.options import BlockChoice
from accel.core.state import ProcessState, state
from accel.errors import ConfigError
from accel.parallel.blockwise import CompilePlan, checkpoint_blocks, compile_blocks

__all__ = ["prepare_pipelined"]


def prepare_pipelined(
    model: nn.Module, stage_options: Callable[[ProcessState, Mapping[str, Any]], dict[str, Any]],
    strategy_options: Mapping[str, Any], *,
    checkpointing: BlockChoice, plan: CompilePlan | None, evaluation_mode: bool,
    device_placement: bool, tp_plan: object, convert: Callable[[nn.Module], None],
    pipeline: dict[str, Any],
) -> bool:
    """Split ``model`` into this rank's pipeline stages (TP inside each over the ``tp`` dim,
    then FSDP2 over the data-parallel dims, then regional compilation of its blocks); whether
    it was split (not without a ``pp`` dim: a plan given is checked, the model left whole).

    Args:
        model: the user's module.
        stage_options: the block's engine's ``stage_options`` (its options become the
            stages' FSDP2 options).
        strategy_options: ``prepare_model``'s ``**strategy_options``.
        checkpointing: the blocks whose activations are recomputed.
        plan: ``prepare_model``'s ``compile`` choice.
        evaluation_mode: inference only (no sharding).
        device_placement: move the stages to the state's device.
        tp_plan: ``prepare_model``'s ``tp_plan``.
        convert: the precision mode's layer swap for the whole model (fp8).
        pipeline: ``plan``, ``schedule``, ``microbatches``, ``stages_per_rank``.

    Raises:
        ConfigError: whole-model compilation, or a ``cp`` dim beside the ``pp`` dim.
    """
    st = state()
    if pipeline.get("plan") is None and st.pp_world_size == 1:
        return False  # no pipeline asked for
    from accel.parallel.pipeline.stages import pipeline_model

    tp_styles = None
    given: dict[str, Any] = {}
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
        given = stage_options(st, strategy_options)
        tp_styles = _stage_tensor_plan(model, tp_plan)
    shard = None
    if st.dp_world_size > 1 and not evaluation_mode and st.pp_world_size > 1:
        from accel.parallel import fsdp

        sharding = fsdp.fsdp_options(st.options, given)

        def shard(module: nn.Module) -> nn.Module:
            return fsdp.shard_model(module, sharding, device_placement=device_placement)

    def checkpoint(view: nn.Module) -> None:
        checkpoint_blocks(view, checkpointing)

    def compile_view(view: nn.Module) -> None:
        assert plan is not None  # set when compile_view is passed
        compile_blocks(view, plan.regional, plan.options)

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
    from accel.parallel.tensor_parallel import plan_to_apply
    from accel.parallel.tp_plan import check_plan

    st = state()
    chosen_plan = plan_to_apply(model, tp_plan)
    if chosen_plan is None:
        return None
    checked = check_plan(model, chosen_plan, st.tp_world_size)
    return checked if st.tp_world_size > 1 else None

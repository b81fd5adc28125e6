"""``prepare_model``'s pipeline path: this rank's stages, TP, FSDP and regional compile
inside each, torch's ``PipelineStage`` objects and the schedule.

The user's model is changed in place: the units no local stage holds become pass-throughs
(their weights are freed), so ``model.parameters()`` are this rank's and ``model.state_dict()``
keeps the global (unsplit) names. Each local stage runs through a :class:`StageModule` around
its view of the model (:func:`accel.parallel.pipeline.split.stage_view`); with a ``tp`` dim,
the stages' share of the tensor-parallel plan (checked on the whole model) splits their
modules first; with a data-parallel dim, FSDP2 shards the stage's blocks and then the stage
module, which torch's stage drives (it syncs the gradients once, after the last microbatch).
The schedule and the stages live in a :class:`Pipeline` record kept with the model.

Example:
    >>> pipe = pipeline_model(net, plan="auto", schedule="1F1B", microbatches=4)
    >>> pipeline_of(net).stage_indices
    (0,)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import nn

from accel.core.options import BlockChoice
from accel.core.state import state
from accel.errors import ConfigError
from accel.parallel.pipeline.agreement import Agreed
from accel.parallel.pipeline.schedules import (
    ScheduleSpec,
    build_schedule,
    check_schedule,
    schedule_spec,
)
from accel.parallel.pipeline.split import (
    Inbox,
    StageExit,
    StagePlan,
    crossed_modules,
    keep_stages,
    split_points,
    stage_plan,
    stage_view,
)
from accel.parallel.pipeline.ties import Tie, find_ties, link_ties, mark_copies
from accel.parallel.pipeline.trace import trace_forward

__all__ = ["LossSlot", "Pipeline", "StageModule", "pipeline_model", "pipeline_of",
           "stage_styles", "tensor_output"]

_PIPELINE = "_accel_pipeline"  # in the prepared model's __dict__: its Pipeline record


def tensor_output(out: Any) -> Any:
    """A stage's output as torch's stage sends it: a tensor (or a tuple of them); a
    transformers output gives its logits.

    Example:
        >>> tensor_output(llama(input_ids=ids)).shape  # the logits
        torch.Size([2, 6, 64])
    """
    if isinstance(out, torch.Tensor | tuple):
        return out
    if isinstance(out, Mapping):  # a transformers ModelOutput: the logits, else the first
        if "logits" in out:
            return out["logits"]
        return next(iter(out.values()))
    raise ConfigError(
        f"A pipeline stage returned {type(out).__name__}; torch's stages pass tensors. Make "
        "the model's forward return a tensor (or a transformers output with logits)."
    )


class StageModule(nn.Module):
    """Runs one stage: the view's forward on what the previous stage sent, as a tensor.

    Example:
        >>> StageModule(view)(hidden).shape
        torch.Size([8, 16])
    """

    def __init__(self, view: nn.Module, embeds: bool = False, inbox: Inbox | None = None
                 ) -> None:
        super().__init__()
        self.inner = view
        self._kwargs = {"use_cache": False} if "use_cache" in forward_names(view) else {}
        self._embeds = embeds
        self._inbox = inbox

    def forward(self, *args: Any) -> Any:
        """The view's output (a transformers output gives its logits); a stage after the
        first of a model whose forward takes ``inputs_embeds`` is fed that way, and its
        :class:`~accel.parallel.pipeline.split.Handoff` gives its first unit the input."""
        inbox = self._inbox if len(args) == 1 else None
        if inbox is not None:
            inbox.value = args[0]
        try:
            if self._embeds and len(args) == 1:
                return tensor_output(self.inner(inputs_embeds=args[0], **self._kwargs))
            return tensor_output(self.inner(*args, **self._kwargs))
        except StageExit as done:  # reached the next stage's first unit: the stage's output
            return done.value
        finally:
            if inbox is not None:
                inbox.value = None


def forward_names(module: nn.Module) -> set[str]:
    """The parameter names of ``module.forward`` (empty when they cannot be read)."""
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


@attrs.define
class LossSlot:
    """The loss function the schedule calls per microbatch, set by each ``pipeline_step``.

    It records each microbatch's loss as the user's function returned it and hands the
    schedule that loss divided by the microbatches (and the accumulation steps), scaled as
    ``accel.backward`` scales it. ``idle`` (a step run on stand-in labels, which then raises
    on every rank) gives a zero loss instead of calling the function.

    Example:
        >>> slot = LossSlot(); slot.fn = nn.functional.mse_loss
    """

    fn: Callable[..., torch.Tensor] | None = None
    scale: Callable[[torch.Tensor], torch.Tensor] = attrs.field(default=lambda loss: loss)
    losses: list[torch.Tensor] = attrs.field(factory=list)
    idle: bool = False

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        """The scaled loss of one microbatch (the unscaled one recorded)."""
        assert self.fn is not None, "set by pipeline_step before the schedule runs"
        if self.idle:  # zero, but through the outputs: the backward runs as it would
            outs = output if isinstance(output, tuple | list) else (output,)
            loss = sum((o.float().sum() * 0.0 for o in outs
                        if isinstance(o, torch.Tensor) and o.is_floating_point()),
                       torch.zeros((), device=state().device))
        else:
            loss = self.fn(output, target)
        self.losses.append(loss.detach())
        return self.scale(loss)


@attrs.frozen(eq=False)
class Pipeline:
    """What ``pipeline_step`` needs of a pipelined model: its schedule and this rank's stages.

    Example:
        >>> pipeline_of(model).microbatches
        4
    """

    spec: ScheduleSpec
    schedule: Any
    stages: tuple[Any, ...]
    modules: tuple[StageModule, ...]
    stage_indices: tuple[int, ...]
    num_stages: int
    microbatches: int
    slot: LossSlot
    group: Any
    units: tuple[str, ...]
    """The unsplit model's units in order (full weights are put back in this order)."""
    last_rank: int
    """The pipeline rank holding the last stage (the loss is broadcast from it)."""
    ties: tuple[Tie, ...] = ()
    """Parameters tied across stages (their gradients are summed after each step)."""
    stage_units: tuple[tuple[str, ...], ...] = ()
    """Every stage's own units, by stage number (what ``save_state`` records)."""
    rank_stages: tuple[tuple[int, ...], ...] = ()
    """The stages each pipeline rank runs, by pipeline rank."""
    agreed: Agreed = attrs.field(factory=Agreed)
    """The batch shapes the ranks agreed on at the first step (torch's stages keep them)."""

    @property
    def has_first(self) -> bool:
        """Whether this rank runs stage 0 (it reads the inputs)."""
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.stage_indices


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The pipeline record of a model ``prepare_model`` split, else ``None``.

    Example:
        >>> pipeline_of(nn.Linear(2, 2)) is None
        True
    """
    record = model.__dict__.get(_PIPELINE)
    return record if isinstance(record, Pipeline) else None


def _check_names(model: nn.Module, plan: object) -> None:
    """Without a ``pp`` dim: the split points named must exist (the model stays whole)."""
    if isinstance(plan, list | tuple):
        crossed_modules(model, [str(p) for p in plan])
    elif isinstance(plan, bool) or not (isinstance(plan, int) or plan == "auto"):
        split_points(model, plan, 1)  # raises the plan's kind error


def _check_wrappings(spec: ScheduleSpec, dp: int, checkpointing: BlockChoice) -> None:
    if spec.zero_bubble and dp > 1:
        raise ConfigError(
            f"pp_schedule={spec.name!r} splits each backward into input and weight gradients, "
            "which FSDP (data parallel inside each stage, dp_world_size="
            f"{dp}) does not support yet. Use 'GPipe', '1F1B', 'Interleaved1F1B' or "
            "'LoopedBFS' with data parallelism, or no data-parallel dim."
        )
    if spec.zero_bubble and checkpointing is not False:
        raise ConfigError(
            f"pp_schedule={spec.name!r} splits the backward in two, which activation "
            "checkpointing (activation_checkpointing=...) cannot recompute correctly. Use "
            "'1F1B' or 'Interleaved1F1B', or turn activation checkpointing off."
        )


def _check_tied_shards(ties: list[Tie], local: tuple[int, ...], sharded: bool) -> None:
    """FSDP shards each stage on its own: a parameter two local stages share cannot be."""
    for tie in ties:
        here = sorted({s for s in tie.stages if s in local})
        if sharded and len(here) > 1:
            raise ConfigError(
                f"{tie.names[0]!r} and {tie.names[-1]!r} are one tied parameter used by "
                f"stages {here}, which this rank both runs (the schedule's layout), and FSDP "
                "(data parallelism inside the stages) shards each stage on its own, so it "
                "cannot shard one parameter for both. Use a schedule that puts those stages "
                "on different ranks (e.g. '1F1B' or 'Interleaved1F1B'), no data-parallel dim, "
                "or untie them (`tie_word_embeddings=False`)."
            )


def stage_styles(chosen: Mapping[str, Any], plan: StagePlan, local: tuple[int, ...]
                 ) -> dict[str, Any]:
    """The entries of a tensor-parallel plan (checked on the whole model) that fall inside
    this rank's stages.

    Raises:
        ConfigError: a planned module the pipeline split crosses (no one stage holds it).

    Example:
        >>> sorted(stage_styles({"layers.0.up": s, "layers.3.up": s}, plan, (0,)))
        ['layers.0.up']
    """
    crossed = sorted(name for name in chosen if name in plan.crossed)
    if crossed:
        raise ConfigError(
            f"tp_plan splits {crossed[:3]}, which the pipeline split (pp_plan) crosses: no "
            "one stage holds it, so it cannot be split inside a stage. Plan the layers inside "
            "the blocks (e.g. 'layers.*.mlp.up_proj'), or split the pipeline elsewhere."
        )
    mine = {unit for index in local for unit in plan.units_of(index)}
    return {name: style for name, style in chosen.items()
            if any(name == unit or name.startswith(unit + ".") for unit in mine)}


def pipeline_model(
    model: nn.Module,
    *,
    plan: object,
    schedule: object,
    microbatches: object,
    stages_per_rank: object,
    device_placement: bool,
    shard: Callable[[nn.Module], nn.Module] | None,
    checkpoint: Callable[[nn.Module], None] | None,
    checkpointing: BlockChoice = False,
    convert: Callable[[nn.Module], None] | None = None,
    tp_styles: Mapping[str, Any] | None = None,
    compile_blocks: Callable[[nn.Module], None] | None = None,
) -> bool:
    """Split ``model`` in place into this rank's pipeline stages; whether it was split.

    Without a ``pp`` dim (``pp_size`` 1) the plan is checked and the model left whole
    (``pipeline_step`` then runs it as one stage), so one script runs on any mesh.

    Args:
        model: the user's module.
        plan: ``pp_plan`` (split points, a number of stages, or ``"auto"``).
        schedule: ``pp_schedule``, one of torch's schedule names (default ``"1F1B"``).
        microbatches: microbatches per step (default: the number of stages).
        stages_per_rank: stages each rank runs (interleaved and V schedules).
        device_placement: move the stages to the state's device.
        shard: FSDP2 for one stage module (``None`` without a data-parallel dim).
        checkpoint: activation checkpointing of one stage view's blocks, or ``None``.
        checkpointing: the activation checkpointing choice (to refuse what does not mix).
        convert: the precision mode's layer swap (fp8) for the whole model, run once the
            plan is checked and before it is split.
        tp_styles: tensor parallelism inside the stages: the plan checked on the whole
            model (module name -> torch style); each rank splits its stages' modules over
            the ``tp`` dim, before FSDP (``None``: no ``tp`` dim or no plan).
        compile_blocks: regional compilation of one stage view's blocks (after FSDP), or
            ``None``.

    Raises:
        ConfigError: any plan, schedule or wrapping problem, before anything is changed.

    Example:
        >>> pipeline_model(net, plan="auto", schedule="GPipe", microbatches=2,
        ...                stages_per_rank=None, device_placement=True, shard=None,
        ...                checkpoint=None)
        True
    """
    spec = schedule_spec("1F1B" if schedule is None else schedule)
    st = state()
    pp = st.pp_world_size
    given = spec.default_stages_per_rank if stages_per_rank is None else stages_per_rank
    default = pp * given if isinstance(given, int) else 1  # one microbatch per stage
    per_rank, count = check_schedule(
        spec, pp_size=pp, stages_per_rank=given,
        microbatches=default if microbatches is None else microbatches,
    )
    if pp == 1:
        _check_names(model, plan)
        return False
    _check_wrappings(spec, st.dp_world_size, checkpointing)
    num_stages = pp * per_rank
    splits = split_points(model, "auto" if plan is None else plan, num_stages)
    plan_of = stage_plan(model, splits, trace_forward(model))
    local = spec.stages_of(st.pp_rank, pp, per_rank)
    styles = None if tp_styles is None else stage_styles(tp_styles, plan_of, local)
    ties = find_ties(model, plan_of)
    _check_tied_shards(ties, local, shard is not None)
    if convert is not None:
        convert(model)
    before = dict(model.named_parameters())
    keep_stages(model, plan_of, local)
    if device_placement:
        model.to(st.device)
    link_ties(ties, model, [spec.stages_of(r, pp, per_rank) for r in range(pp)], local)
    if styles is not None:  # TP inside the stages: what crosses a boundary is a plain tensor
        from accel.parallel.tensor_parallel import split_modules
        from accel.precision.registry import precision_for

        split_modules(model, styles, st.mesh,
                      styles=precision_for(st.mixed_precision).parallel_styles)
    embeds = "inputs_embeds" in forward_names(model)
    from torch.distributed.pipelining import PipelineStage

    from accel.core.mesh import pp_mesh
    from accel.precision.casting import prepare_forward

    group = pp_mesh(st.mesh).get_group()
    modules, stages = [], []
    for index in local:
        inbox = Inbox()
        view = stage_view(model, plan_of, index, embeds=embeds and index > 0, inbox=inbox)
        if checkpoint is not None:
            checkpoint(view)
        module: nn.Module = StageModule(view, embeds=embeds and index > 0, inbox=inbox)
        if shard is not None:
            module = shard(module)
        if compile_blocks is not None:  # in place, after sharding (as without a pipeline)
            compile_blocks(view)
        prepare_forward(module)  # the mode's autocast, floating outputs back in fp32
        modules.append(module)
        stages.append(PipelineStage(module, index, num_stages, st.device, group=group))
    slot = LossSlot()
    record = Pipeline(
        spec=spec, schedule=build_schedule(spec, stages, count, slot), stages=tuple(stages),
        modules=tuple(modules),  # type: ignore[arg-type]
        stage_indices=local, num_stages=num_stages, microbatches=count, slot=slot,
        group=group, units=plan_of.units, last_rank=0 if spec.layout == "v" else pp - 1,
        ties=tuple(ties),
        stage_units=tuple(tuple(u for u, s in zip(plan_of.units, plan_of.stages, strict=True)
                                if s == index) for index in range(num_stages)),
        rank_stages=tuple(spec.stages_of(r, pp, per_rank) for r in range(pp)),
    )
    mark_copies(ties, model)  # the parameters as sharded: each tie counted once in norms
    model.__dict__[_PIPELINE] = record
    from accel.parallel.fsdp_params import mark_replaced

    kept = {id(p) for p in model.parameters()}  # a tied copy kept under its other name
    mark_replaced(model, {n: p for n, p in before.items() if id(p) not in kept})
    # an optimizer made before: what left this rank is moved over, or refused
    return True


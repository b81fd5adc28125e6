"""The last stage's outputs on every rank of a pipeline, and ``accel.pipeline_forward``.

A pipelined model's outputs exist on the rank running the last stage only. Both
``pipeline_step(..., return_outputs=True)`` and :func:`pipeline_forward` hand them to every
rank of the pipeline (a broadcast over the ``pp`` group from that rank: the structure and
shapes as one small object, then each tensor), so every rank calls
``accel.gather_for_metrics(outputs)`` the same way (it keeps one pipeline stage's ranks, so
each sample comes back once).

``pipeline_forward`` runs the forwards only, under ``torch.no_grad()``, on forward-only
``PipelineStage`` objects of its own around this rank's stage modules: torch infers the
shapes the stages pass on their first step and keeps them, so a batch of other shapes (an
evaluation batch, a longer sequence while generating) gets stages of its own, kept for the
next call of the same shapes (the last few shapes are kept).

Example:
    >>> logits = accel.pipeline_forward(model, input_ids)   # every rank: the full logits
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from accel.core.state import state
from accel.errors import ArgumentTypeError, ConfigError
from accel.parallel.pipeline.stages import Pipeline, pipeline_of, tensor_output

__all__ = ["as_args", "forward_outputs", "pipeline_forward", "share_outputs",
           "unwrapped_stage_error"]

_FORWARDS = "_accel_pipeline_forwards"  # in the model's __dict__: shapes -> forward schedule
_KEPT = 8  # forward-only schedules kept per model (one per batch shape)


def as_args(inputs: Any) -> tuple[Any, ...]:
    """The forward's positional arguments: a tuple or list as they are, else one argument."""
    return tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)


def unwrapped_stage_error(error: RuntimeError) -> BaseException:
    """The user's own exception inside torch's "[Stage N] failed to run forward" wrapper.

    torch re-raises what a stage's forward raised as a ``RuntimeError`` whose message ends
    with the arguments' shapes; the launcher names a failing rank by the last line of its
    error, so the original (its traceback runs through the user's forward) is raised
    instead. Anything else is returned as it is.

    Example:
        >>> unwrapped_stage_error(RuntimeError("x")).args
        ('x',)
    """
    cause = error.__cause__
    if isinstance(cause, Exception) and "failed to run forward" in str(error):
        return cause
    return error


def share_outputs(pipe: Pipeline, outputs: Any) -> Any:
    """The last stage's ``outputs`` (a tensor or a tuple of them) on every pipeline rank.

    Every rank of the pipeline group must call it; ranks without the last stage pass
    ``None``. The tensors come back detached, on the state's device.

    Example:
        >>> share_outputs(pipe, logits if pipe.has_last else None).shape
        torch.Size([8, 6, 64])
    """
    import torch.distributed as dist

    device = state().device
    if pipe.has_last:
        leaves = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
        meta: Any = (isinstance(outputs, tuple | list),
                     [(tuple(t.shape), t.dtype) for t in leaves])
    else:
        leaves, meta = [], None
    box = [meta]
    dist.broadcast_object_list(box, group=pipe.group, group_src=pipe.last_rank,
                               device=device if device.type != "cpu" else None)
    many, shapes = box[0]
    if pipe.has_last:
        tensors = [t.detach().to(device).contiguous() for t in leaves]
    else:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    for tensor in tensors:
        dist.broadcast(tensor, group=pipe.group, group_src=pipe.last_rank)
    return tuple(tensors) if many else tensors[0]


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a)
                 for a in args)


def _v_forwards() -> Any:
    """torch's LoopedBFS over the V layout (rank ``r``: stages ``r`` and ``2P - 1 - r``).

    The V schedules (ZBVZeroBubble, DualPipeV) cannot run forwards only (their fused
    forward-backward steps need a backward); breadth first by stage, each rank's lower stage
    first, needs none and cannot deadlock (every stage waits on lower ones only).
    """
    from torch.distributed.pipelining.schedules import (
        ScheduleLoopedBFS,
        _Action,
        _ComputationType,
    )

    class VForwards(ScheduleLoopedBFS):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            forwards = {_ComputationType.FORWARD, _ComputationType.SEND_F,
                        _ComputationType.RECV_F}  # torch's runtime would run the backwards
            self.pipeline_order_with_comms = {
                rank: [a for a in actions if a is not None and a.computation_type in forwards]
                for rank, actions in self.pipeline_order_with_comms.items()
            }

        def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
            stages = (rank, 2 * self.pp_group_size - 1 - rank)
            count = self._n_microbatches
            ops: list[Any] = [_Action(s, _ComputationType.FORWARD, mb)
                              for s in stages for mb in range(count)]
            return ops + [_Action(s, _ComputationType.FULL_BACKWARD, mb)  # dropped above
                          for s in reversed(stages) for mb in reversed(range(count))]

    return VForwards


def _forward_schedule(model: nn.Module, pipe: Pipeline, args: tuple[Any, ...],
                      microbatches: int) -> Any:
    """A forward-only schedule over new stages around this rank's stage modules, one per
    batch shape (the same on every rank: every rank is given the same batch)."""
    from torch.distributed.pipelining import PipelineStage

    from accel.parallel.pipeline.schedules import build_schedule

    kept: OrderedDict[tuple[Any, ...], Any] = model.__dict__.setdefault(_FORWARDS, OrderedDict())
    key = (_signature(args), microbatches)
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    device = state().device
    stages = [PipelineStage(module, index, pipe.num_stages, device, group=pipe.group)
              for module, index in zip(pipe.modules, pipe.stage_indices, strict=True)]
    if pipe.spec.layout == "v":
        kept[key] = _v_forwards()(stages, microbatches, loss_fn=None, scale_grads=False)
    else:  # forwards only: a single-stage schedule is GPipe's, a looped one LoopedBFS's
        from accel.parallel.pipeline.schedules import schedule_spec

        name = "GPipe" if pipe.spec.layout == "single" else "LoopedBFS"
        kept[key] = build_schedule(schedule_spec(name), stages, microbatches, None)
    if len(kept) > _KEPT:
        kept.popitem(last=False)
    return kept[key]


def pipeline_forward(model: nn.Module, inputs: Any, *, microbatches: int | None = None
                     ) -> Any:
    """The model's outputs for ``inputs``, run through its pipeline: the same on every rank.

    The inference counterpart of ``accel.pipeline_step`` (Accelerate's ``prepare_pippy``):
    call it on every rank of the pipeline with the same inputs (a tensor or a tuple of the
    forward's positional arguments); the first stage reads them, the stages run their
    forwards only (under ``torch.no_grad()``) microbatch by microbatch, and the last stage's
    outputs (a tensor, a tuple of tensors, or a transformers output's logits) come back on
    every rank, detached, so ``accel.gather_for_metrics(outputs)`` and a generation loop run
    the same way everywhere. Without a ``pp`` dim it is the model's forward under
    ``torch.no_grad()``.

    Args:
        model: what ``accel.prepare_model(model, pp_plan=...)`` returned.
        inputs: the batch's inputs.
        microbatches: microbatches for this call (default: the model's ``microbatches``);
            it must divide the batch (1 runs the batch whole, e.g. while generating with a
            batch of 1).

    Returns:
        The last stage's outputs for the whole batch, on every rank.

    Raises:
        ArgumentTypeError: ``model`` is not a module.
        ConfigError: microbatches that are not an integer >= 1 or do not divide the batch.

    Example:
        >>> logits = accel.pipeline_forward(model, input_ids)
        >>> next_token = logits[:, -1].argmax(-1)
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"pipeline_forward takes the prepared model, got {type(model).__name__}. Call it "
            "as `accel.pipeline_forward(model, inputs)`."
        )
    args = as_args(inputs)
    pipe = pipeline_of(model)
    with torch.no_grad():
        if pipe is None:
            return tensor_output(model(*args))
        count = pipe.microbatches if microbatches is None else microbatches
        size = next((int(a.shape[0]) for a in args
                     if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        if (isinstance(count, bool) or not isinstance(count, int) or count < 1
                or (size is not None and size % count)):
            raise ConfigError(
                f"pipeline_forward: microbatches={count!r} must be an integer >= 1 that "
                f"divides the batch of {size} samples. Pass `microbatches=` that divides it "
                "(1 runs the batch whole)."
            )
        return share_outputs(pipe, forward_outputs(model, pipe, args, count))


def forward_outputs(model: nn.Module, pipe: Pipeline, args: tuple[Any, ...],
                    microbatches: int) -> Any:
    """The forwards only of every microbatch through the pipeline: the last stage's outputs
    for the whole batch on the rank holding it, ``None`` on the others.

    Every rank of the pipeline calls it with the same ``args`` (their shapes key the
    forward-only stages); call it under ``torch.no_grad()``.

    Example:
        >>> out = forward_outputs(model, pipe, (x,), 4)
    """
    schedule = _forward_schedule(model, pipe, args, microbatches)
    try:
        return schedule.eval(*(args if pipe.has_first else ()), return_outputs=True)
    except RuntimeError as error:
        cause = unwrapped_stage_error(error)
        if cause is error:
            raise
        raise cause from None

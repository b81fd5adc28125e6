"""``accel.pipeline_step``: one training step of a pipelined model, the same call on every rank.

The first stage reads the inputs, the last computes ``loss_fn(outputs, labels)`` per
microbatch, torch's schedule runs the forwards and backwards, and every rank gets the mean
loss (broadcast over the pipeline group from the rank holding the last stage). Gradients are
left in the parameters as ``accel.backward`` leaves them: each microbatch's loss is divided by
the microbatches and the accumulation steps and scaled for fp16, so they equal the gradient of
one process's mean loss over the batch. The gradients of a parameter tied across stages are
then summed over the ranks holding it, on the step that ends an accumulation cycle
(:mod:`accel.parallel.pipeline.ties`). The ranks' batch shapes are compared on every step, on
the first before the schedule and then inside the loss's exchange
(:mod:`accel.parallel.pipeline.agreement`): ranks fed different batches raise alike.

Example:
    >>> loss = accel.pipeline_step(model, x, y, loss_fn=nn.functional.cross_entropy)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel.core.scope import scope
from accel.core.state import state
from accel.errors import ArgumentTypeError, ConfigError
from accel.parallel.pipeline.agreement import (
    LOSS,
    Agreed,
    batch_row,
    check_rows,
    exchange,
    signature,
    stand_in,
)
from accel.parallel.pipeline.outputs import (
    as_args,
    forward_outputs,
    share_outputs,
    unwrapped_stage_error,
)
from accel.parallel.pipeline.stages import Pipeline, pipeline_of, tensor_output
from accel.parallel.pipeline.ties import sync_tied_grads
from accel.precision.registry import PRECISIONS

__all__ = ["pipeline_step"]


def _batch_size(value: Any) -> int | None:
    for item in as_args(value):
        if isinstance(item, torch.Tensor) and item.dim() > 0:
            return int(item.shape[0])
    return None


def _scaler(divide: int) -> Callable[[torch.Tensor], torch.Tensor]:
    unit = PRECISIONS[state().mixed_precision]

    def scale(loss: torch.Tensor) -> torch.Tensor:
        return unit.scale_loss(loss / divide if divide > 1 else loss)

    return scale


def _detached(outputs: Any) -> Any:
    if isinstance(outputs, tuple | list):
        return tuple(t.detach() for t in outputs)
    return outputs.detach()


def _whole(model: nn.Module, inputs: Any, labels: Any, loss_fn: Callable[..., Any]
           ) -> tuple[torch.Tensor, Any]:
    """A model that is not split (no ``pp`` dim): forward, loss, ``accel.backward``'s backward."""
    outputs = tensor_output(model(*as_args(inputs)))
    loss = loss_fn(outputs, labels)
    scaled = _scaler(state().gradient_accumulation_steps)(loss)
    if scaled.requires_grad:
        scaled.backward()  # type: ignore[no-untyped-call]
    return loss.detach(), _detached(outputs)


def _check_split(pipe: Pipeline, inputs: Any, labels: Any) -> None:
    size = _batch_size(inputs if pipe.has_first else labels)
    if size is not None and size % pipe.microbatches:
        raise ConfigError(
            f"The batch of {size} samples does not split into microbatches="
            f"{pipe.microbatches} equal parts (torch would make uneven microbatches, whose "
            "mean is not the batch's). Use a batch size divisible by the microbatches, or "
            "`accel.prepare_model(..., microbatches=...)` that divides it."
        )


def _agree(pipe: Pipeline, inputs: Any, labels: Any, agreed: Agreed, mean: torch.Tensor | None
           ) -> list[list[float]]:
    """Every rank's batch row (and the last stage's ``mean``) on every rank, checked: one
    ``all_gather`` over the pipeline group."""
    row = torch.tensor(batch_row(inputs, labels, agreed), dtype=torch.float64,
                       device=state().device)
    if mean is not None and pipe.has_last:
        row[LOSS] = mean.detach().to(torch.float64)
    rows = exchange(pipe.group, row)
    check_rows(rows, group=pipe.group, rank_stages=pipe.rank_stages, agreed=agreed)
    return rows


def _run(model: nn.Module, pipe: Pipeline, inputs: Any, labels: Any,
         loss_fn: Callable[..., Any], return_outputs: bool) -> tuple[torch.Tensor, Any]:
    st = state()
    device = st.device
    agreed = pipe.agreed
    if not torch.is_grad_enabled():  # forward-only stages of their own, keyed by the shapes
        _agree(pipe, inputs, labels, Agreed(), None)
        _check_split(pipe, inputs, labels)
        return _evaluate(model, pipe, inputs, labels, loss_fn, return_outputs)
    swap_inputs = swap_labels = False
    if not agreed.done:  # the first step: torch's stages take the shapes they will keep
        rows = _agree(pipe, inputs, labels, agreed, None)
        _check_split(pipe, inputs, labels)
        agreed.keep(inputs, labels, rows)
    else:  # a batch of other shapes runs on a stand-in; the step's exchange then raises
        swap_inputs = (pipe.has_first and agreed.inputs is not None
                       and signature(inputs) != agreed.inputs)
        swap_labels = (pipe.has_last and agreed.labels is not None
                       and signature(labels) != agreed.labels)
    if st.mixed_precision == "fp16":  # every stage's GradScaler takes its scale now (only
        # the last stage scales a loss; the others unscale the gradients that loss sent
        # back, by the same agreed scale)
        PRECISIONS["fp16"].scale_loss(torch.ones((), device=device))
    slot = pipe.slot
    slot.fn, slot.losses, slot.idle = loss_fn, [], swap_labels
    slot.scale = _scaler(pipe.microbatches * st.gradient_accumulation_steps)
    args: tuple[Any, ...] = ()
    if pipe.has_first:
        args = (stand_in(agreed.inputs, inputs, device) if swap_inputs and agreed.inputs
                else as_args(inputs))
    target = labels if pipe.has_last else None
    if swap_labels and agreed.labels is not None:
        shaped = stand_in(agreed.labels, labels, device)
        target = shaped if isinstance(labels, tuple | list) else shaped[0]
    try:
        outputs = pipe.schedule.step(*args, target=target, return_outputs=return_outputs)
    except RuntimeError as error:  # the user's own error out of torch's stage wrapper
        cause = unwrapped_stage_error(error)
        if cause is error:
            raise
        raise cause from None
    finally:
        slot.fn, slot.idle = None, False
    if pipe.ties and scope().sync_gradients:  # the step's gradients are complete
        sync_tied_grads(pipe.ties, model)  # (and FSDP's reduced): the tied copies' summed
    # the last M: torch's first step also calls the loss once on its shape-inference output
    mean = (torch.stack(slot.losses[-pipe.microbatches:]).float().mean().to(device) if pipe.has_last
            else torch.zeros((), dtype=torch.float32, device=device))
    slot.losses = []
    return _shared(pipe, mean, outputs, return_outputs, inputs, labels, agreed)


def _shared(pipe: Pipeline, mean: torch.Tensor, outputs: Any, return_outputs: bool,
            inputs: Any, labels: Any, agreed: Agreed) -> tuple[torch.Tensor, Any]:
    """The last stage's mean loss on every rank, the ranks' batch shapes checked with it (one
    ``all_gather`` in place of a broadcast); the outputs too when asked."""
    rows = _agree(pipe, inputs, labels, agreed, mean)
    shared = torch.tensor(rows[pipe.last_rank][LOSS], dtype=torch.float32, device=mean.device)
    return shared, share_outputs(pipe, outputs) if return_outputs else None


def _evaluate(model: nn.Module, pipe: Pipeline, inputs: Any, labels: Any,
              loss_fn: Callable[..., Any], return_outputs: bool) -> tuple[torch.Tensor, Any]:
    """Under ``torch.no_grad()``: the forwards only (forward-only stages of their own, which
    every schedule's layout runs), the loss of each microbatch on the last stage."""
    device = state().device
    outputs = forward_outputs(model, pipe, as_args(inputs), pipe.microbatches)
    if pipe.has_last:
        count = pipe.microbatches
        pieces = (list(zip(*(o.tensor_split(count) for o in outputs), strict=True))
                  if isinstance(outputs, tuple) else outputs.tensor_split(count))
        targets = (labels.tensor_split(count) if isinstance(labels, torch.Tensor)
                   else [labels] * count)
        mean = torch.stack([loss_fn(tuple(p) if isinstance(p, tuple) else p, t).float()
                            for p, t in zip(pieces, targets, strict=True)]).mean().to(device)
    else:
        mean = torch.zeros((), dtype=torch.float32, device=device)
    return _shared(pipe, mean, outputs, return_outputs, inputs, labels, Agreed())


def pipeline_step(
    model: nn.Module, inputs: Any, labels: Any, *, loss_fn: Callable[..., torch.Tensor],
    return_outputs: bool = False,
) -> Any:
    """Run one training step of ``model`` through its pipeline; every rank gets the mean loss.

    Call it on every rank with the same batch (a prepared loader gives every stage of a
    data-parallel replica the same batches): the first stage reads ``inputs`` (a tensor or a
    tuple of the forward's positional arguments), the last stage computes ``loss_fn(outputs,
    labels)`` for each microbatch (``prepare_model(..., microbatches=M)`` splits the batch
    into ``M``), and the gradients are left in the parameters as after ``accel.backward``
    (then step the prepared optimizer as usual, inside ``accel.accumulate`` too). Under
    ``torch.no_grad()`` it runs the forwards only and returns the loss. A model that is not
    split (``pp_size`` 1) runs forward, loss and backward as one stage.

    Args:
        model: what ``accel.prepare_model(model, pp_plan=...)`` returned.
        inputs: the batch's inputs (read by the first stage).
        labels: the batch's labels (read by the last stage).
        loss_fn: ``loss_fn(outputs, labels) -> loss``, a mean over the microbatch's samples.
        return_outputs: also return the last stage's outputs for the whole batch (the
            microbatches' outputs concatenated, detached), broadcast to every rank of the
            pipeline, so that every rank calls ``accel.gather_for_metrics(outputs)`` alike.

    Returns:
        The mean of the microbatches' losses, a 0-d tensor, the same on every rank of the
        pipeline (detached: the backward already ran); with ``return_outputs=True`` the pair
        ``(loss, outputs)``.

    Raises:
        ConfigError: a batch the microbatches do not divide, or (on every rank) a batch of
            other shapes than the first step's, which torch's stages keep.
        CollectiveMismatchError: (on every rank) the ranks of the pipeline were given
            batches of different shapes; names each rank's.
        ArgumentTypeError: ``model`` is not a module or ``loss_fn`` not callable.

    Example:
        >>> with accel.accumulate(model):
        ...     loss = accel.pipeline_step(model, x, y, loss_fn=nn.functional.mse_loss)
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise ArgumentTypeError(
            f"pipeline_step takes the prepared model and a loss function, got "
            f"{type(model).__name__} and {type(loss_fn).__name__}. Call it as "
            "`accel.pipeline_step(model, inputs, labels, loss_fn=fn)`."
        )
    pipe = pipeline_of(model)
    if pipe is None:
        loss, outputs = _whole(model, inputs, labels, loss_fn)
    else:
        loss, outputs = _run(model, pipe, inputs, labels, loss_fn, bool(return_outputs))
    return (loss, outputs) if return_outputs else loss

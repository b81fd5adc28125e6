"""The loss of the whole batch from this rank's pieces of it (:func:`sequence_loss`).

Each rank sums the cross-entropy of its tokens (``shift_labels``, ``-100`` skipped), divides by
the global batch's targets over the data-parallel ranks, and the parts are summed over the cp
group: every cp rank holds the same value, and the gradients DDP/FSDP average are one
process's.

Example:
    >>> loss = sequence_loss(logits, piece["shift_labels"])    # the same on every cp rank
    >>> accel.backward(loss)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from accel.parallel.context_parallel.autograd import _apply, _SumOverGroup
from accel.parallel.context_parallel.plan import _Plan, _plan
from accel.parallel.context_parallel.sharding import IGNORE_INDEX

__all__ = ["sequence_loss"]


def sequence_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The next-token cross-entropy of the whole global batch, from this rank's pieces.

    Sums this rank's token losses (``shift_labels`` from :func:`shard_sequence`; ``-100`` is
    skipped; fp32), divides by the number of targets, and sums over the cp group, so every cp
    rank returns the same value. The count is, unless ``num_items_in_batch`` gives it, the
    targets of the GLOBAL batch divided by the data-parallel size (one all-reduce over every
    rank): then the mean of the returned losses over the ranks (``accel.reduce(loss,
    "mean")``) is the global batch's mean over its targets, each counted once, and the
    gradients DDP/FSDP average are one process's, even where ranks hold different numbers of
    targets (``-100`` labels, the last token of each sequence). Every rank must call it.

    Example:
        >>> piece = shard_sequence(batch)
        >>> logits = model(piece["input_ids"], piece["position_ids"])   # (B, S/C, vocab)
        >>> loss = sequence_loss(logits, piece["shift_labels"])
        >>> accel.backward(loss)
    """
    return _loss(logits, shift_labels, num_items_in_batch, _plan())


def _loss(logits: torch.Tensor, shift_labels: torch.Tensor,
          num_items_in_batch: int | torch.Tensor | None, plan: _Plan | None) -> torch.Tensor:
    total = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    count: int | torch.Tensor
    if num_items_in_batch is not None:
        count = num_items_in_batch
    else:  # the global batch's targets over the data-parallel ranks (see sequence_loss)
        count = (shift_labels != IGNORE_INDEX).sum().to(total.device, torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
            count = count * (1 if plan is None else plan.size) / dist.get_world_size()
    if isinstance(count, torch.Tensor):
        count = count.to(total.device, total.dtype)
    part = total / count
    if plan is None:
        return part
    return _apply(_SumOverGroup, part, plan.group())

"""A batch's sequences split over the cp ranks (:func:`shard_sequence`) and put back together
(:func:`gather_sequence`).

The pieces are contiguous (``"alltoall"``) or head-and-tail (``"ring"``: rank ``r`` holds
chunks ``r`` and ``2C-1-r`` of ``2C``, which balances causal work); labels are shifted into
``shift_labels`` BEFORE the split and the positions are the global ones. The cp ranks first
compare their batch's shape (:func:`_agree`: one ``all_gather`` of six integers over the cp
group), so ranks given different batches raise alike instead of failing in attention's
all-to-all (gloo aborts on it).

Example:
    >>> piece = shard_sequence({"input_ids": ids, "labels": ids})   # ids: (B, S)
    >>> gather_sequence(piece["input_ids"]).equal(ids)               # on every cp rank
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from accel.core.state import state
from accel.errors import CollectiveMismatchError, ConfigError
from accel.parallel.context_parallel.autograd import _apply, _Gather
from accel.parallel.context_parallel.plan import _Plan, _plan

__all__ = ["IGNORE_INDEX", "gather_sequence", "shard_sequence"]

IGNORE_INDEX = -100
"""The label of a token without target (transformers' and torch's ``ignore_index``)."""
_SHARDED_KEYS = ("input_ids", "inputs_embeds", "position_ids", "token_type_ids", "labels",
                 "shift_labels")


def _positions(length: int, plan: _Plan, device: torch.device) -> torch.Tensor:
    """The global positions this rank holds (contiguous, or head-and-tail for ring)."""
    if plan.balanced:
        chunk = length // (2 * plan.size)
        head = torch.arange(plan.rank * chunk, (plan.rank + 1) * chunk, device=device)
        tail_start = (2 * plan.size - 1 - plan.rank) * chunk
        return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])
    piece = length // plan.size
    return torch.arange(plan.rank * piece, (plan.rank + 1) * piece, device=device)


def _piece(tensor: torch.Tensor, plan: _Plan) -> torch.Tensor:
    index = _positions(tensor.shape[1], plan, tensor.device)
    if not plan.balanced:
        return tensor.narrow(1, int(index[0]), index.numel())
    return tensor.index_select(1, index)


def _check_length(length: int, plan: _Plan) -> None:
    parts = 2 * plan.size if plan.balanced else plan.size
    if length % parts:
        how = (f"2 x cp_size = {parts} (ring attention splits each sequence into head and tail "
               "chunks)" if plan.balanced else f"cp_size={parts}")
        raise ConfigError(
            f"Context parallelism splits each sequence over the cp ranks, but the sequence "
            f"length {length} does not divide by {how}. Pad the batch to a multiple of {parts} "
            f"(labels {IGNORE_INDEX} on the padding, e.g. `pad_to_multiple_of={parts}` in "
            "transformers' data collators)."
        )


def _row(first: Any, embeds: bool, mask: Any) -> list[int]:
    """A batch as six integers: which input (0 none, 1 ids, 2 embeddings), its dims, its
    (batch, sequence, width) and whether its attention mask masks a token."""
    if not isinstance(first, torch.Tensor):
        return [0, 0, -1, -1, -1, 0]
    dims = [int(d) for d in first.shape[:3]] + [-1] * (3 - min(first.ndim, 3))
    masked = isinstance(mask, torch.Tensor) and not bool(mask.all())
    return [2 if embeds else 1, first.ndim, *dims, int(masked)]


def _shape(row: list[int]) -> str:
    if not row[0]:
        return "no input_ids or inputs_embeds"
    name = "inputs_embeds" if row[0] == 2 else "input_ids"
    shape = tuple(d for d in row[2:5] if d >= 0)
    return f"{name} {shape!r}" + (" (more dims)" if row[1] > 3 else "")


def _first(batch: Mapping[str, Any]) -> tuple[Any, bool]:
    """The batch's ``input_ids``, else its ``inputs_embeds`` (and whether it is those)."""
    first = batch.get("input_ids")
    return (batch.get("inputs_embeds"), True) if first is None else (first, False)


def _agree(batch: Mapping[str, Any], plan: _Plan) -> bool:
    """Check that every cp rank's batch has the same shape (:func:`_row`): one ``all_gather``
    of six integers over the cp group, before any collective whose sizes depend on it and
    before any check that may raise; whether any rank's attention mask masks a token."""
    import torch.distributed as dist

    group = plan.group()
    first, embeds = _first(batch)
    mine = _row(first, embeds, batch.get("attention_mask"))
    sent = torch.tensor(mine, dtype=torch.int64, device=state().device)
    every = torch.empty(plan.size * len(mine), dtype=torch.int64, device=sent.device)
    dist.all_gather_single(every, sent, group=group)
    flat = every.tolist()
    rows = [flat[r * len(mine):(r + 1) * len(mine)] for r in range(plan.size)]
    if any(row[:5] != rows[0][:5] for row in rows):
        said = "; ".join(f"rank {dist.get_global_rank(group, r)}: {_shape(row)}"
                         for r, row in enumerate(rows))
        raise CollectiveMismatchError(
            f"Context parallelism: the ranks of one cp group were given batches of different "
            f"shapes ({said}); each keeps its piece of every sequence of the SAME batch, and "
            "attention exchanges the pieces. Give every rank of a cp group the same batches "
            "(e.g. through `accel.prepare_data_loader(loader)`, which shards by the "
            "data-parallel rank only), padded to one length."
        )
    return any(row[5] for row in rows)


def shard_sequence(batch: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's piece of a whole batch, split on the sequence dim (dim 1) over the cp group.

    ``input_ids``/``inputs_embeds``, ``token_type_ids`` and ``position_ids`` (made when absent:
    the GLOBAL positions ``0..S-1``, for RoPE and learned positions) are split alike. ``labels``
    are shifted BEFORE the split into ``shift_labels`` (the target of token ``t`` is label
    ``t+1``; the last is ``-100``), so no target is lost at a piece's border. An
    ``attention_mask`` of ones is
    dropped; one that masks tokens is refused. Other keys pass through. Without a ``cp`` dim > 1
    it returns the batch with ``shift_labels`` added. Under one, every rank of the cp group
    must call it: the ranks compare their batch's shape first (one ``all_gather`` of six
    integers over the cp group; on CUDA it reads them back, a device sync) and raise alike.

    Raises:
        CollectiveMismatchError: (on every cp rank) the ranks were given batches of
            different shapes; names each rank's.
        ConfigError: a sequence length that the cp size does not divide (2 x cp size for
            ring), or an attention mask with zeros (on any cp rank).

    Example:
        >>> piece = shard_sequence({"input_ids": ids, "labels": ids})   # ids: (B, S)
        >>> piece["input_ids"].shape, sorted(piece)      # on each of 2 cp ranks
        (torch.Size([B, S/2]), ['input_ids', 'labels', 'position_ids', 'shift_labels'])
    """
    plan = _plan()
    return _shard(batch, plan, masked=None if plan is None else _agree(batch, plan))


def _shard(batch: Mapping[str, Any], plan: _Plan | None, *, masked: bool | None = None
           ) -> dict[str, Any]:
    """The split (no communication); ``masked``: whether any cp rank's mask masks a token
    (:func:`_agree`), else this rank's own mask is looked at."""
    out = dict(batch)
    first, _ = _first(out)
    mask = out.pop("attention_mask", None)
    if masked is None:
        masked = isinstance(mask, torch.Tensor) and not bool(mask.all())
    if not isinstance(first, torch.Tensor) or first.ndim < 2:
        raise ConfigError(
            "shard_sequence needs `input_ids` (batch, sequence) or `inputs_embeds` in the "
            f"batch; got keys {sorted(batch)}."
        )
    length = first.shape[1]
    if plan is not None and masked:
        raise ConfigError(
            "Context parallelism takes no padding mask: the batch's attention_mask masks "
            "tokens. Pack sequences without padding, or pad at the end with labels -100 and "
            "drop the attention_mask (a causal model never attends to later tokens)."
        )
    if mask is not None and plan is None:
        out["attention_mask"] = mask
    labels = out.get("labels")
    if out.get("shift_labels") is None and isinstance(labels, torch.Tensor) and labels.ndim > 1:
        out["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if plan is None:
        return out
    _check_length(length, plan)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(length, device=first.device).expand(
            first.shape[0], -1)
    for key in _SHARDED_KEYS:
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.ndim > 1 and value.shape[1] == length:
            out[key] = _piece(value, plan)
    return out


def gather_sequence(tensor: torch.Tensor) -> torch.Tensor:
    """The whole sequence (dim 1) from every cp rank's piece, in order; differentiable.

    The inverse of :func:`shard_sequence`'s split (head-and-tail pieces are put back in
    place). Without a ``cp`` dim > 1 it returns ``tensor``. Every rank of the cp group must
    call it.

    Example:
        >>> logits = gather_sequence(model(**shard_sequence(batch)).logits)  # (B, S, vocab)
    """
    plan = _plan()
    return tensor if plan is None else _gather(tensor, plan)


def _gather(tensor: torch.Tensor, plan: _Plan) -> torch.Tensor:
    whole = _apply(_Gather, tensor, plan.group(), 1)
    if not plan.balanced:
        return whole
    length = tensor.shape[1] * plan.size
    order = torch.cat([_positions(length, attrs.evolve(plan, rank=r), tensor.device)
                       for r in range(plan.size)])
    return whole.index_select(1, torch.argsort(order))

"""``gather_for_metrics``: gather per-batch results and drop the padding of the last round.

Prepared loaders complete their last round with samples repeated from the start of the epoch
(``even_batches``, iterable datasets, dispatched batches). On the last batch of the active
prepared loader (``accel.core.scope.scope().active_loaders[-1]``), :func:`gather_for_metrics`
keeps only the real samples of each rank, so that over an epoch the gathered results hold
every sample of the dataset exactly once, in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import attrs
import torch

from accel.comm.collectives import gather, gather_object, refuse_gated
from accel.core.scope import scope
from accel.core.state import state
from accel.core.tree import first_non_tensor, map_tensors, tensor_leaves, zip_map_tensors

__all__ = ["FinalRound", "gather_for_metrics", "merge_gathered_objects", "trim_gathered"]

T = TypeVar("T")


@attrs.frozen
class FinalRound:
    """The last round of an epoch: each rank's batch size and how many of its samples are real.

    Real samples always come first in a rank's batch; the rest is padding (samples repeated
    from the start of the epoch). Concatenating each rank's real samples in rank order gives
    the last samples of the epoch in order.

    Example:
        >>> FinalRound(sizes=(3, 3), real=(3, 0)).remainder
        3
    """

    sizes: tuple[int, ...]
    real: tuple[int, ...]

    @property
    def remainder(self) -> int:
        """Real samples in the final global batch (all ranks together)."""
        return sum(self.real)

    @property
    def padded(self) -> bool:
        """True when some rank's final batch holds padding."""
        return self.sizes != self.real

    @property
    def ragged(self) -> bool:
        """True when the ranks' final batches differ in size (gathering needs padding)."""
        return len(set(self.sizes)) > 1

    @property
    def is_prefix(self) -> bool:
        """True when the real samples are a prefix of the gathered final batch."""
        seen_short = False
        for size, real in zip(self.sizes, self.real, strict=True):
            if seen_short and real:
                return False
            seen_short = seen_short or real < size
        return not self.ragged


def _active_loader() -> tuple[FinalRound | None, int, bool]:
    """The innermost loader's final round and remainder (at its last batch) and raggedness."""
    loaders = scope().active_loaders
    if not loaders:
        return None, -1, False
    loader = loaders[-1]
    ragged = bool(getattr(loader, "ragged_batches", False))
    if not getattr(loader, "end_of_dataloader", False):
        return None, -1, ragged
    final = getattr(loader, "final_round", None)
    remainder = getattr(loader, "remainder", -1)
    return (final if isinstance(final, FinalRound) else None), int(remainder), ragged


def _pad_rows(rows: int, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.ndim == 0 or tensor.shape[0] == rows:
        return tensor
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out


def _dp_rows(world: int, tp: int, span: int, gathered: torch.Tensor) -> torch.Tensor:
    """Of a tensor gathered from ``world`` ranks, the parts of each tensor-parallel group's
    first rank among the first ``span`` ranks (the others hold the same samples)."""
    return gathered.reshape(world, -1, *gathered.shape[1:])[:span:tp].reshape(
        -1, *gathered.shape[1:]
    )


def _gather_ragged(
    data: T, world: int, real: tuple[int, ...] | None, tp: int = 1, span: int | None = None
) -> T:
    """Gather tensors whose first dimension differs between ranks, keeping real rows only.

    Two collectives: the sizes of every leaf on every rank, then the leaves padded to the
    longest. Rank ``r``'s rows are cut to its size (and to ``real[r // tp]`` when given); of
    each tensor-parallel group of ``tp`` ranks only the first one's rows are kept, of the first
    ``span`` ranks (one pipeline stage's) when given.
    """
    leaves = tensor_leaves(data)
    if not leaves:
        return gather(data)
    mine = torch.tensor([t.shape[0] if t.ndim else 0 for t in leaves], device=leaves[0].device)
    sizes = gather(mine).reshape(world, len(leaves)).tolist()
    longest = [max(sizes[r][j] for r in range(world)) for j in range(len(leaves))]
    position = iter(range(len(leaves)))
    padded = map_tensors(lambda t: _pad_rows(longest[next(position)], t), data)
    gathered = gather(padded)
    position = iter(range(len(leaves)))

    def cut(original: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        j = next(position)
        if original.ndim == 0:
            return merged
        ranks = range(0, world if span is None else span, tp)
        keep = [sizes[r][j] if real is None else min(sizes[r][j], real[r // tp]) for r in ranks]
        return torch.cat(
            [merged[r * longest[j] : r * longest[j] + n] for r, n in zip(ranks, keep, strict=True)]
        )

    return zip_map_tensors(cut, data, gathered)


def _trim_one(
    final: FinalRound | None, prefix: int, original: torch.Tensor, gathered: torch.Tensor
) -> torch.Tensor:
    if original.ndim == 0:  # one value per rank (e.g. a loss): nothing to trim
        return gathered
    if final is None:
        return gathered[:prefix] if prefix >= 0 else gathered
    if final.is_prefix:
        return gathered[: final.remainder]
    world = len(final.real)
    rows = gathered.shape[0] // world
    pieces = [
        gathered[rank * rows : rank * rows + real]
        for rank, real in enumerate(final.real)
        if real
    ]
    return torch.cat(pieces) if pieces else gathered[:0]


def trim_gathered(
    original: T, gathered: T, final: FinalRound | None, *, prefix: int = -1
) -> T:
    """Drop the padding from tensors gathered on the last batch of an epoch.

    ``gathered`` holds each rank's tensors (padded to a common length) concatenated in rank
    order; ``final.real`` says how many leading rows of each rank's part are real. Without a
    final round, ``prefix >= 0`` keeps that many leading rows. 0-d tensors are not trimmed.

    Example:
        >>> final = FinalRound(sizes=(3, 3), real=(3, 0))
        >>> trim_gathered(torch.zeros(3), torch.arange(6), final)
        tensor([0, 1, 2])
    """
    if final is None and prefix < 0:
        return gathered
    trimmed: T = zip_map_tensors(partial(_trim_one, final, prefix), original, gathered)
    return trimmed


def _take(value: Any, count: int | None) -> Any:
    return value if count is None else value[:count]


def merge_gathered_objects(per_rank: Sequence[Any], real: Sequence[int] | None = None) -> Any:
    """Merge what :func:`accel.gather_object` returned into one batch of samples.

    Lists and tuples are sample lists: they are concatenated in rank order (each cut to its
    rank's ``real`` count when given). Tensors are concatenated on dim 0 (0-d ones stacked),
    dicts are merged key by key; any other value gives the list of per-rank values.

    Example:
        >>> merge_gathered_objects([["a", "b"], ["c", "a"]], real=(2, 1))
        ['a', 'b', 'c']
    """
    counts: Sequence[int | None] = real if real is not None else [None] * len(per_rank)
    first = per_rank[0]
    if all(isinstance(part, torch.Tensor) for part in per_rank):
        if first.ndim == 0:
            return torch.stack(list(per_rank))
        return torch.cat([_take(part, c) for part, c in zip(per_rank, counts, strict=True)])
    if all(isinstance(part, Mapping) for part in per_rank):
        return type(first)(
            {key: merge_gathered_objects([part[key] for part in per_rank], real)
             for key in first}
        )
    if all(isinstance(part, list | tuple) for part in per_rank):
        merged: list[Any] = []
        for part, count in zip(per_rank, counts, strict=True):
            merged.extend(_take(part, count))
        return merged
    return list(per_rank)


def _trim_local(data: Any, rows: int, as_objects: bool) -> Any:
    """One process, last batch: keep the first ``rows`` samples (what N processes keep).

    Tensors are cut on dim 0 (0-d ones kept). Data gathered as objects on N processes
    (``as_objects``) follows :func:`merge_gathered_objects`: lists and tuples are sample lists
    and are cut, dicts are recursed into, anything else is kept.
    """
    if not as_objects:
        return map_tensors(lambda t: t if t.ndim == 0 else t[:rows], data)

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value if value.ndim == 0 else value[:rows]
        if isinstance(value, Mapping):
            kind: Any = type(value)
            return kind({key: cut(item) for key, item in value.items()})
        if isinstance(value, list | tuple):
            return value[:rows]
        return value

    return cut(data)


def gather_for_metrics(data: T, *, use_gather_object: bool = False) -> T:
    """Gather per-batch results from every rank, without the padding of the last round.

    Every rank must call it. Tensors (nested lists, tuples and dicts of them) are gathered
    with :func:`accel.gather`; anything else, or everything with ``use_gather_object=True``,
    with :func:`accel.gather_object` and merged by :func:`merge_gathered_objects` (lists are
    sample lists, concatenated). On the last batch of the active prepared loader each rank's
    padding is dropped, so over an epoch the results hold exactly the dataset's samples (with
    ``drop_last``, the samples the loader yielded). Every tensor's first dimension must be the
    batch dimension (0-d tensors give one value per rank and are not trimmed). On one process
    nothing is gathered, but the last batch is cut to its real sample count all the same, so
    the results are the same on every world size (e.g. for ``loss.repeat(batch_size)``).
    Outside a prepared loader's iteration it is a plain gather. Where batch sizes differ
    between ranks (variable-size batch samplers, the last round without ``even_batches``)
    tensors are padded, gathered and cut back to each rank's rows. With ``even_batches=False``
    ranks may get different numbers of batches; call it only where every rank has a batch.

    Args:
        data: This rank's results for the current batch.
        use_gather_object: Gather as Python objects even if ``data`` holds only tensors
            (e.g. tensors whose sizes differ between ranks in other dimensions).

    Returns:
        The gathered results, padding removed.

    Example:
        >>> loader = accel.prepare_data_loader(DataLoader(range(9), batch_size=5))
        >>> for batch in loader:
        ...     seen = accel.gather_for_metrics(batch)
        >>> len(seen)  # 10 samples were read on 2 processes, 1 was padding
        9
    """
    refuse_gated("gather_for_metrics")  # on one process too, as on N
    st = state()
    # The ranks of one context- and tensor-parallel group (neighbours) share their samples,
    # and so do the pipeline stages: the first stage's ranks hold each sample once.
    world, tp = st.world_size, st.cp_world_size * st.tp_world_size
    span = world // st.pp_world_size
    final, remainder, ragged = _active_loader()
    as_objects = use_gather_object or first_non_tensor(data) is not None
    if world == 1:
        if remainder <= 0:
            return data
        return _trim_local(data, remainder, as_objects)  # type: ignore[no-any-return]
    if as_objects:
        per_rank = gather_object(data)[:span:tp]  # a cp x tp group shares its samples
        if final is not None:
            return merge_gathered_objects(per_rank, final.real)  # type: ignore[no-any-return]
        merged = merge_gathered_objects(per_rank)
        if remainder >= 0 and isinstance(merged, list):
            return merged[:remainder]  # type: ignore[return-value]
        return merged  # type: ignore[no-any-return]
    if ragged or (final is not None and final.ragged):
        return _gather_ragged(data, world, None if final is None else final.real, tp, span)
    gathered = gather(data)
    if tp > 1 or span < world:  # each sample once: one rank per cp x tp group, one stage
        gathered = map_tensors(partial(_dp_rows, world, tp, span), gathered)
    if (final is None and remainder < 0) or (final is not None and not final.padded):
        return gathered
    return trim_gathered(data, gathered, final, prefix=remainder)

"""Iterable datasets: which elements of a stream each rank reads (Accelerate's rule).

:func:`shard_stream` is Accelerate's ``IterableDatasetShard`` rule as a pure generator;
:class:`StreamShard` applies it per epoch inside the loaders of :mod:`accel.data` (stream
mode, and rank 0's reader in dispatch mode).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from torch.utils.data import IterableDataset

from accel.comm.metrics import FinalRound
from accel.data._epoch_seeds import Reseeder
from accel.data._rounds import Recorder, grow, split_counts

__all__ = ["StreamShard", "shard_stream", "stream_final_round"]

T = TypeVar("T")


def shard_stream(
    elements: Iterable[T],
    *,
    rank: int,
    world_size: int,
    per_rank: int,
    drop_last: bool,
    skip: int = 0,
    keep: int = 0,
    record: Recorder | None = None,
) -> Iterator[T]:
    """This rank's elements of a stream, Accelerate's ``IterableDatasetShard`` rule.

    The stream is read in chunks of ``per_rank * world_size`` elements and rank ``r`` takes
    elements ``[r * per_rank, (r + 1) * per_rank)`` of each chunk, so each chunk is one batch
    per rank. A short last chunk is dropped with ``drop_last``, else completed by cycling
    from the first chunk (with one process it is passed on as is).

    Args:
        elements: The dataset's elements for one epoch.
        rank: This process's rank.
        world_size: Number of processes.
        per_rank: Elements per rank and chunk (the per-rank batch size).
        drop_last: Drop a short last chunk.
        skip: Number of this rank's elements to read and drop (resuming), after the first
            ``keep`` ones.
        keep: Number of this rank's leading elements yielded before skipping.
        record: Called once at the end with the :class:`FinalRound` (in batches of
            ``per_rank``).

    Example:
        >>> list(shard_stream(range(7), rank=1, world_size=2, per_rank=2, drop_last=False))
        [2, 3, 6, 0]
    """
    chunk_size = per_rank * world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    first: list[T] | None = None
    chunk: list[T] = []
    sent = 0
    full = False
    for element in elements:
        chunk.append(element)
        if len(chunk) == chunk_size:
            for item in chunk[lo:hi]:
                if sent < keep or sent >= keep + skip:
                    yield item
                sent += 1
            if first is None:
                first = chunk
            full = True
            chunk = []
    whole = (per_rank,) * world_size
    if not chunk or drop_last:
        if full and record is not None:
            record(FinalRound(sizes=whole, real=whole))
        return
    if world_size == 1:
        tail: Sequence[T] = chunk
        final = FinalRound(sizes=(len(chunk),), real=(len(chunk),))
    else:
        pool = grow(list(first if first is not None else chunk), chunk_size)
        tail = (chunk + pool[: chunk_size - len(chunk)])[lo:hi]
        final = FinalRound(sizes=whole, real=split_counts(len(chunk), per_rank, world_size))
    for item in tail:
        if sent < keep or sent >= keep + skip:
            yield item
        sent += 1
    if record is not None:
        record(final)


def stream_final_round(
    length: int, *, world_size: int, per_rank: int, drop_last: bool
) -> FinalRound | None:
    """The :class:`FinalRound` :func:`shard_stream` reports for a stream of ``length`` items.

    Example:
        >>> stream_final_round(7, world_size=2, per_rank=2, drop_last=False)
        FinalRound(sizes=(2, 2), real=(2, 1))
    """
    chunk_size = per_rank * world_size
    full, short = divmod(length, chunk_size)
    whole = (per_rank,) * world_size
    if short == 0 or drop_last:
        return FinalRound(sizes=whole, real=whole) if full else None
    if world_size == 1:
        return FinalRound(sizes=(short,), real=(short,))
    return FinalRound(sizes=whole, real=split_counts(short, per_rank, world_size))


class StreamShard(IterableDataset[Any]):
    """This rank's elements of an iterable dataset (see :func:`shard_stream`).

    Example:
        >>> list(StreamShard(range(5), rank=1, world_size=2, per_rank=2, drop_last=False))
        [2, 3, 1, 2]
    """

    def __init__(
        self, dataset: Any, *, rank: int, world_size: int, per_rank: int, drop_last: bool
    ) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.per_rank = per_rank
        self.drop_last = drop_last
        self.skip = 0
        self.keep = 0  # elements yielded before the skipped ones
        self.reseed = Reseeder(None, 0, ())  # run by the loader, in the main process
        self.final_round: FinalRound | None = None

    def _record(self, final: FinalRound) -> None:
        self.final_round = final

    def __iter__(self) -> Iterator[Any]:
        self.final_round = None
        return shard_stream(
            self.dataset,
            rank=self.rank,
            world_size=self.world_size,
            per_rank=self.per_rank,
            drop_last=self.drop_last,
            skip=self.skip,
            keep=self.keep,
            record=self._record,
        )

    def __len__(self) -> int:
        length = len(self.dataset)
        chunk = self.per_rank * self.world_size
        if self.world_size == 1:
            return length
        chunks = length // chunk if self.drop_last else -(-length // chunk)
        return chunks * self.per_rank

    def expected_final_round(self) -> FinalRound | None:
        """The last round computed from ``len(dataset)``, or ``None`` for unsized datasets."""
        if not hasattr(self.dataset, "__len__"):
            return None
        return stream_final_round(
            len(self.dataset),
            world_size=self.world_size,
            per_rank=self.per_rank,
            drop_last=self.drop_last,
        )

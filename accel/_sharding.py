"""Sharding maths: which indices or samples each rank gets, and the padding at the end.

The generators here are pure (no processes, no devices); :class:`ShardedBatchSampler` and
:class:`StreamShard` apply them per epoch inside the loaders of :mod:`accel.data`. The rules
are Accelerate's (``BatchSamplerShard``, ``IterableDatasetShard``, ``DataLoaderDispatcher``)
so that ported training scripts see the same batches:

- without ``split_batches``, batch ``i`` of the original loader goes to rank
  ``i % world_size``; with it, every batch is cut into ``world_size`` equal slices;
- ``even_batches`` completes the last round by cycling from the start of the epoch, so every
  rank gets the same number of batches of the same size;
- ``drop_last`` drops the last round when it is not complete.

Every generator reports the last round as a :class:`FinalRound` so that
``gather_for_metrics`` can drop exactly the padding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler

from accel.errors import ConfigError

__all__ = [
    "FinalRound",
    "Reseeder",
    "ShardSpec",
    "ShardedBatchSampler",
    "StreamShard",
    "dispatch_slice_size",
    "shard_stream",
    "skip_first",
    "split_counts",
    "stream_final_round",
]

T = TypeVar("T")
Batch = list[Any]
Recorder = Callable[["FinalRound"], None]


def split_counts(real: int, per_rank: int, world_size: int) -> tuple[int, ...]:
    """How many of ``real`` samples land on each rank when slices of ``per_rank`` are dealt out.

    Example:
        >>> split_counts(5, 2, 4)
        (2, 2, 1, 0)
    """
    return tuple(min(per_rank, max(0, real - rank * per_rank)) for rank in range(world_size))


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


def skip_first(items: Iterable[T], count: int, *, keep: int = 0) -> Iterator[T]:
    """Yield ``items`` without ``count`` of them after the first ``keep`` (still consuming them).

    Example:
        >>> list(skip_first([[0], [1], [2]], 2))
        [[2]]
        >>> list(skip_first("abcde", 2, keep=1))
        ['a', 'd', 'e']
    """
    for index, item in enumerate(items):
        if index < keep or index >= keep + count:
            yield item


def _grow(pool: list[T], needed: int) -> list[T]:
    """Repeat ``pool`` until it holds at least ``needed`` items (for tiny datasets)."""
    while pool and len(pool) < needed:
        pool = pool + pool
    return pool


@attrs.frozen(kw_only=True)
class ShardSpec:
    """How one rank takes its share of a batch sampler's batches.

    Args:
        rank: This process's rank.
        world_size: Number of processes.
        batch_size: The batch sampler's batch size, or ``None`` for variable-size batches.
        drop_last: Whether the batch sampler drops its last short batch; the shard then also
            drops an incomplete last round.
        split_batches: Cut every batch into ``world_size`` slices instead of dealing batches.
        even_batches: Complete the last round by cycling from the start of the epoch.

    Raises:
        ConfigError: ``split_batches`` with a batch size that is unknown or not a multiple of
            ``world_size``.

    Example:
        >>> spec = ShardSpec(rank=1, world_size=2, batch_size=3)
        >>> list(spec.shard([[0, 1, 2], [3, 4, 5], [6, 7, 8]]))
        [[3, 4, 5], [0, 1, 2]]
    """

    rank: int
    world_size: int
    batch_size: int | None
    drop_last: bool = False
    split_batches: bool = False
    even_batches: bool = True

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank={self.rank!r} is not a rank of a world of size {self.world_size!r}."
            )
        if self.split_batches and (
            self.batch_size is None or self.batch_size % self.world_size != 0
        ):
            raise ConfigError(
                f"split_batches=True cuts every batch into {self.world_size} equal slices, but "
                f"the batch size is {self.batch_size!r}, which is not a multiple of "
                f"{self.world_size}. Use a batch size that is a multiple of the number of "
                "processes, or `prepare_data_loader(loader, split_batches=False)`."
            )

    def num_batches(self, total_batches: int, last_batch_size: int | None = None) -> int:
        """The number of batches this rank gets from a sampler of ``total_batches`` batches.

        Args:
            total_batches: ``len(batch_sampler)``.
            last_batch_size: Size of the sampler's last batch when known; only needed for
                ``split_batches`` without ``even_batches`` (a short last batch may not reach
                the higher ranks).

        Example:
            >>> ShardSpec(rank=1, world_size=2, batch_size=3, even_batches=False).num_batches(7)
            3
        """
        if self.split_batches:
            if (
                self.even_batches
                or self.drop_last
                or last_batch_size is None
                or self.batch_size is None
                or not 0 < last_batch_size < self.batch_size
                or total_batches == 0
            ):
                return total_batches
            per_rank = self.batch_size // self.world_size
            reaches = last_batch_size > per_rank * self.rank
            return total_batches if reaches else total_batches - 1
        rounds, extra = divmod(total_batches, self.world_size)
        if extra == 0 or self.drop_last:
            return rounds
        if self.even_batches:
            return rounds + 1
        return rounds + (1 if self.rank < extra else 0)

    def shard(
        self,
        batches: Iterable[Batch],
        record: Recorder | None = None,
        even: Callable[[], bool] | None = None,
    ) -> Iterator[Batch]:
        """This rank's batches, in order; ``record`` receives the last round when known.

        Args:
            batches: The batch sampler's batches (lists of indices) for one epoch.
            record: Called once, after the last batch, with the :class:`FinalRound`.
            even: Read at the end of the epoch instead of ``even_batches`` (so that it can
                change while the epoch runs, as ``join_uneven_inputs`` does).

        Example:
            >>> spec = ShardSpec(rank=0, world_size=2, batch_size=4, split_batches=True)
            >>> list(spec.shard([[0, 1, 2, 3], [4, 5, 6, 7]]))
            [[0, 1], [4, 5]]
        """
        even_now = even if even is not None else self._even
        if self.world_size == 1:
            return self._whole(batches, record)
        if self.split_batches:
            return self._split(batches, record, even_now)
        return self._deal(batches, record, even_now)

    def _even(self) -> bool:
        return self.even_batches

    @staticmethod
    def _whole(batches: Iterable[Batch], record: Recorder | None) -> Iterator[Batch]:
        size = -1
        for batch in batches:
            size = len(batch)
            yield batch
        if size >= 0 and record is not None:
            record(FinalRound(sizes=(size,), real=(size,)))

    def _deal(
        self, batches: Iterable[Batch], record: Recorder | None, even: Callable[[], bool]
    ) -> Iterator[Batch]:
        world, rank, size = self.world_size, self.rank, self.batch_size
        keep_pool = not self.drop_last
        pool: list[Any] = []  # first round: flat indices (fixed size) or batches (variable)
        pool_batches = 0
        current: list[Batch] = []
        last: tuple[int, ...] | None = None
        for batch in batches:
            if keep_pool and pool_batches < world:
                if size is None:
                    pool.append(batch)
                else:
                    pool.extend(batch)
                pool_batches += 1
            if len(current) == world:  # a short batch completed a round but more came
                if even():
                    raise ConfigError(
                        f"the batch sampler yielded a batch of {len(current[-1])} indices "
                        f"before its end although its batch_size is {size!r}; "
                        "even_batches=True needs full batches until the last. Use "
                        "`prepare_data_loader(loader, even_batches=False)`."
                    )
                yield current[rank]
                last = tuple(len(b) for b in current)
                current = []
            current.append(batch)
            if len(current) == world and (size is None or len(batch) == size):
                yield current[rank]
                last = tuple(len(b) for b in current)
                current = []
        if not current or self.drop_last:
            if last is not None and record is not None:
                record(FinalRound(sizes=last, real=last))
            return
        if not even():
            sizes = tuple(len(current[r]) if r < len(current) else 0 for r in range(world))
            if rank < len(current):
                yield current[rank]
            if record is not None:
                record(FinalRound(sizes=sizes, real=sizes))
            return
        yield from self._complete(current, pool, record)

    def _complete(
        self, current: list[Batch], pool: list[Any], record: Recorder | None
    ) -> Iterator[Batch]:
        world, rank, size = self.world_size, self.rank, self.batch_size
        pool = _grow(pool, world if size is None else world * size)
        position = 0
        sizes: list[int] = []
        real: list[int] = []
        mine: Batch = []
        for slot in range(world):
            if size is None:  # variable-size batches: whole batches cycled from the start
                if slot < len(current):
                    batch, count = current[slot], len(current[slot])
                else:
                    batch, count = pool[position], 0
                    position += 1
            else:
                start = current[slot] if slot < len(current) else []
                need = size - len(start)
                batch = list(start) + pool[position : position + need]
                position += need
                count = len(start)
            sizes.append(len(batch))
            real.append(count)
            if slot == rank:
                mine = batch
        yield mine
        if record is not None:
            record(FinalRound(sizes=tuple(sizes), real=tuple(real)))

    def _split(
        self, batches: Iterable[Batch], record: Recorder | None, even: Callable[[], bool]
    ) -> Iterator[Batch]:
        world, rank = self.world_size, self.rank
        size = self.batch_size
        assert size is not None  # checked in __attrs_post_init__
        per_rank = size // world
        lo, hi = per_rank * rank, per_rank * (rank + 1)
        first: Batch | None = None
        short: Batch | None = None
        full = False
        for batch in batches:
            if short is not None:
                raise ConfigError(
                    f"the batch sampler yielded a batch of {len(short)} indices before its "
                    f"end although its batch_size is {size!r}; split_batches=True needs full "
                    "batches until the last. Use `prepare_data_loader(loader, "
                    "split_batches=False)`."
                )
            if first is None:
                first = list(batch)
            if len(batch) == size:
                full = True
                yield batch[lo:hi]
            else:
                short = batch
        if short is None or self.drop_last:
            if full and record is not None:
                record(FinalRound(sizes=(per_rank,) * world, real=(per_rank,) * world))
            return
        counts = split_counts(len(short), per_rank, world)
        if even():
            pool = _grow(list(first or []), size)
            completed = list(short) + pool[: size - len(short)]
            yield completed[lo:hi]
            if record is not None:
                record(FinalRound(sizes=(per_rank,) * world, real=counts))
            return
        if counts[rank]:
            yield short[lo:hi]
        if record is not None:
            record(FinalRound(sizes=counts, real=counts))


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
        pool = _grow(list(first if first is not None else chunk), chunk_size)
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


def dispatch_slice_size(observed: int, world_size: int, *, last: bool) -> int:
    """Per-rank slice of a dispatched global batch of ``observed`` samples.

    A last batch that does not divide evenly is padded up to ``world_size`` slices of
    ``ceil(observed / world_size)``.

    Raises:
        ConfigError: A batch that is not the last does not divide evenly.

    Example:
        >>> dispatch_slice_size(5, 2, last=True)
        3
    """
    per_rank, extra = divmod(observed, world_size)
    if extra == 0:
        return per_rank
    if not last:
        raise ConfigError(
            f"dispatch_batches=True received a batch of {observed!r} samples, which does not "
            f"split into {world_size} equal parts. Use batches whose size is a multiple of the "
            "number of processes, or `prepare_data_loader(loader, dispatch_batches=False)`."
        )
    return per_rank + 1


# --------------------------------------------------------------------------- torch wrappers


@attrs.define(eq=False)
class Reseeder:
    """Per epoch: reseed the sampler's generator with ``seed + epoch`` and call ``set_epoch``.

    ``seed + epoch`` wraps modulo ``2**64`` (as ``torch.Generator.manual_seed`` reads negative
    seeds), so any seed a generator can hold works for every epoch.

    Example:
        >>> Reseeder(torch.Generator(), 7, (sampler,))(2)  # seed 9, sampler.set_epoch(2)
    """

    generator: torch.Generator | None
    seed: int
    targets: tuple[Any, ...]

    def __call__(self, epoch: int) -> None:
        if self.generator is not None:
            self.generator.manual_seed((self.seed + epoch) % 2**64)  # a generator's range
        for target in self.targets:
            target.set_epoch(epoch)


class ShardedBatchSampler(Sampler[list[Any]]):
    """This rank's batches of a (copied) batch sampler; reseeded per epoch; skips index-only.

    ``epoch``, ``skip`` and ``keep`` are read when an iteration starts; ``final_round`` is set
    when the batch sampler is exhausted.

    Example:
        >>> spec = ShardSpec(rank=1, world_size=2, batch_size=2)
        >>> list(ShardedBatchSampler(BatchSampler(range(6), 2, False), spec, Reseeder(None, 0, ())))
        [[2, 3], [0, 1]]
    """

    def __init__(
        self, batch_sampler: Iterable[list[Any]], spec: ShardSpec, reseed: Reseeder
    ) -> None:
        super().__init__()
        self.batch_sampler = batch_sampler
        self.spec = spec
        self.reseed = reseed
        self.epoch = 0
        self.skip = 0
        self.keep = 0  # batches yielded before the skipped ones
        self.final_round: FinalRound | None = None

    def _record(self, final: FinalRound) -> None:
        self.final_round = final

    @property
    def even_batches(self) -> bool:
        """Whether the last round is completed; may change while an epoch runs."""
        return self.spec.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        if value != self.spec.even_batches:
            self.spec = attrs.evolve(self.spec, even_batches=bool(value))

    def _even(self) -> bool:
        return self.spec.even_batches

    def __iter__(self) -> Iterator[list[Any]]:
        self.reseed(self.epoch)
        self.final_round = None
        batches = self.spec.shard(self.batch_sampler, self._record, self._even)
        return skip_first(batches, self.skip, keep=self.keep) if self.skip else batches

    def __len__(self) -> int:
        total = len(self.batch_sampler)  # type: ignore[arg-type]
        last: int | None = None
        inner = getattr(self.batch_sampler, "sampler", None)
        size = self.spec.batch_size
        if isinstance(self.batch_sampler, BatchSampler) and size and hasattr(inner, "__len__"):
            last = len(inner) % size or size  # type: ignore[arg-type]
        return self.spec.num_batches(total, last)


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

"""Batch samplers: which batches each rank gets, and the padding at the end.

:class:`ShardSpec` is the pure rule (no processes, no devices); :class:`ShardedBatchSampler`
applies it per epoch inside the loaders of :mod:`accel.data`. The rules are Accelerate's
(``BatchSamplerShard``; iterable datasets follow ``IterableDatasetShard`` in
:mod:`accel.data._stream_shard`, dispatched batches ``DataLoaderDispatcher`` in
:mod:`accel.data._broadcast_batches`) so that ported training scripts see the same batches:

- without ``split_batches``, batch ``i`` of the original loader goes to rank
  ``i % world_size``; with it, every batch is cut into ``world_size`` equal slices;
- ``even_batches`` completes the last round by cycling from the start of the epoch, so every
  rank gets the same number of batches of the same size;
- ``drop_last`` drops the last round when it is not complete.

Every generator reports the last round as a :class:`~accel.comm.metrics.FinalRound` so that
``gather_for_metrics`` can drop exactly the padding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
from torch.utils.data import BatchSampler, Sampler

from accel.comm.metrics import FinalRound
from accel.data._epoch_seeds import Reseeder
from accel.data._rounds import Recorder, grow, skip_first, split_counts
from accel.errors import ConfigError

__all__ = ["ShardSpec", "ShardedBatchSampler"]

Batch = list[Any]


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
        if self.split_batches and self.batch_size is not None:  # None refused at creation
            return self._split(batches, self.batch_size, record, even_now)
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
        pool = grow(pool, world if size is None else world * size)
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
        self,
        batches: Iterable[Batch],
        size: int,
        record: Recorder | None,
        even: Callable[[], bool],
    ) -> Iterator[Batch]:
        world, rank = self.world_size, self.rank
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
            pool = grow(list(first or []), size)
            completed = list(short) + pool[: size - len(short)]
            yield completed[lo:hi]
            if record is not None:
                record(FinalRound(sizes=(per_rank,) * world, real=counts))
            return
        if counts[rank]:
            yield short[lo:hi]
        if record is not None:
            record(FinalRound(sizes=counts, real=counts))


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

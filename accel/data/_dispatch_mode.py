"""Dispatch mode: rank 0 reads whole rounds from an unsharded loader and broadcasts them.

Every rank keeps its slice of each round (:mod:`accel.data._broadcast_batches`). The unsharded
loader rank 0 reads is built on every rank (its shuffle seed is rank 0's everywhere, so every
rank's ``state_dict()`` agrees), seeded per epoch and skipping cheaply when resuming.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.utils.data import DataLoader

from accel.comm.metrics import FinalRound
from accel.core.state import state
from accel.data._batch_sampler import ShardedBatchSampler
from accel.data._broadcast_batches import concat_rounds, dispatch_rounds
from accel.data._epoch_seeds import Reseeder, WorkerSeeds
from accel.data._loader_state import shuffle_reseeder
from accel.data._shard_mode import sharded_sampler
from accel.data._stream_mode import stream_shard
from accel.data._stream_shard import StreamShard

if TYPE_CHECKING:
    from accel.data._loader import PreparedDataLoader

__all__ = ["DispatchMode", "dispatch_map", "dispatch_stream"]


@attrs.define(eq=False)
class DispatchMode:
    """A prepared loader's dispatch mode: the unsharded loader and where slices go.

    Example:
        >>> mode, arguments = dispatch_map(DataLoader(range(8), batch_size=2), {}, rank=0,
        ...                                world_size=2, device=torch.device("cpu"),
        ...                                split_batches=False)
        >>> mode.length(loader)  # 4 batches, one round of 2 per step
        2
    """

    base: DataLoader[Any]
    rank: int
    world_size: int
    device: torch.device
    split_batches: bool
    drop_last: bool
    recorded: FinalRound | None = None  # the last round of the epoch being iterated

    @property
    def ragged(self) -> bool:
        """Never: a dispatched round is cut into equal slices."""
        return False

    def length(self, loader: PreparedDataLoader) -> int:
        """This rank's batches in a whole epoch: one per round of the base loader."""
        whole = len(self.base)
        if self.split_batches:
            return whole
        if self.drop_last:
            return whole // self.world_size
        return math.ceil(whole / self.world_size)

    def epoch_batches(self, loader: PreparedDataLoader, epoch: int, start: int) -> Iterator[Any]:
        """All ranks: rank 0 reads whole rounds and broadcasts them; each keeps its slice."""
        group = 1 if self.split_batches else self.world_size
        rounds: Iterator[Any] = iter(())
        reader = state().rank == 0  # self.rank is the data-parallel rank (shared under TP)
        if reader:
            rounds = self._base_rounds(loader.worker_seeds, epoch, start * group, group)
        self.recorded = None
        return dispatch_rounds(
            rounds, rank=self.rank, world_size=self.world_size, device=self.device,
            resume=start > 0, record=self._record, reader=reader,
        )

    def final_round(self) -> FinalRound | None:
        """The last round ``dispatch_rounds`` recorded."""
        return self.recorded

    def shuffle(self) -> Reseeder | None:
        """The base loader's reseeder when it owns a generator (the same on every rank)."""
        base = self.base
        return shuffle_reseeder(base.batch_sampler, base.sampler, base.dataset)

    def set_even(self, value: bool) -> None:
        """Nothing to change: a dispatched last round is always padded to equal slices."""

    def _record(self, final: FinalRound) -> None:
        self.recorded = final

    def _base_rounds(
        self, seeds: WorkerSeeds, epoch: int, skip: int, group: int
    ) -> Iterator[Any]:
        """Rank 0: the base loader's batches, ``group`` at a time, concatenated.

        When resuming (``skip > 0``) the first round is still read (its first samples pad
        the last round, as in an uninterrupted epoch), then ``skip`` batches are skipped.
        """
        base = self.base
        keep = group if skip else 0
        skip -= keep
        sampler = base.batch_sampler
        if not isinstance(sampler, ShardedBatchSampler):
            sampler = base.sampler
        if isinstance(sampler, ShardedBatchSampler):
            sampler.epoch, sampler.skip, sampler.keep = epoch, skip, keep
        dataset = base.dataset
        if isinstance(dataset, StreamShard):
            dataset.skip = skip * dataset.per_rank
            dataset.keep = keep * dataset.per_rank
            dataset.reseed(epoch)
        seeds.apply(base.generator, epoch)
        return concat_rounds(iter(base), group, drop_last=self.drop_last)


def _base_options(options: dict[str, Any]) -> dict[str, Any]:
    return {**options, "generator": torch.Generator()}


def dispatch_stream(
    loader: DataLoader[Any], options: dict[str, Any], *, batch_size: int, rank: int,
    world_size: int, device: torch.device, split_batches: bool,
) -> tuple[DispatchMode, dict[str, Any]]:
    """Dispatch mode for an iterable dataset, and the prepared loader's ``DataLoader`` arguments.

    ``options`` are the ``DataLoader`` options the base loader keeps (workers, collate_fn...).

    Example:
        >>> mode, arguments = dispatch_stream(loader, options, batch_size=4, rank=0,
        ...                                   world_size=2, device=device, split_batches=False)
    """
    drop_last = bool(loader.drop_last)
    stream = stream_shard(
        loader.dataset, rank=0, world_size=1, per_rank=batch_size, drop_last=drop_last
    )
    base = DataLoader(
        stream, batch_size=batch_size, drop_last=drop_last, **_base_options(options)
    )
    mode = DispatchMode(base, rank, world_size, device, split_batches, drop_last)
    return mode, {"dataset": base.dataset, "batch_size": batch_size, "drop_last": drop_last}


def dispatch_map(
    loader: DataLoader[Any], options: dict[str, Any], *, rank: int, world_size: int,
    device: torch.device, split_batches: bool,
) -> tuple[DispatchMode, dict[str, Any]]:
    """Dispatch mode for a map-style dataset, and the prepared loader's ``DataLoader`` arguments.

    ``options`` are the ``DataLoader`` options the base loader keeps (workers, collate_fn...).

    Example:
        >>> mode, arguments = dispatch_map(loader, options, rank=0, world_size=2,
        ...                                device=device, split_batches=False)
    """
    sampler = sharded_sampler(
        loader, rank=0, world_size=1, split_batches=False, even_batches=True
    )
    base: DataLoader[Any]
    if loader.batch_sampler is None:
        base = DataLoader(
            loader.dataset, sampler=sampler, batch_size=None, **_base_options(options)
        )
        arguments = {"dataset": base.dataset, "sampler": base.sampler, "batch_size": None}
    else:
        base = DataLoader(loader.dataset, batch_sampler=sampler, **_base_options(options))
        arguments = {"dataset": base.dataset, "batch_sampler": base.batch_sampler}
    mode = DispatchMode(base, rank, world_size, device, split_batches, bool(loader.drop_last))
    return mode, arguments

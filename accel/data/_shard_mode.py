"""Shard mode: a map-style dataset read through this rank's share of the batch sampler.

The prepared loader's batch sampler is a :class:`~accel.data._batch_sampler.ShardedBatchSampler`
over a copy of the user's batch sampler (its own generator, reseeded per epoch); skipped batches
are skipped by index, never loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
from torch.utils.data import BatchSampler, DataLoader

from accel.comm.metrics import FinalRound
from accel.core.scope import scope
from accel.data._batch_sampler import ShardedBatchSampler, ShardSpec
from accel.data._epoch_seeds import Reseeder, seeded_copy
from accel.data._loader_state import shuffle_reseeder
from accel.errors import ConfigError

if TYPE_CHECKING:
    from accel.data._loader import PreparedDataLoader

__all__ = ["ShardMode", "shard_mode", "sharded_sampler"]


def _even_override() -> bool | None:
    """The ``even_batches`` of the innermost ``join_uneven_inputs(..., even_batches=...)``."""
    return scope().even_batches_override


@attrs.define(eq=False)
class ShardMode:
    """A prepared loader's shard mode: its :class:`~accel.data._batch_sampler.ShardedBatchSampler`.

    Example:
        >>> mode, arguments = shard_mode(DataLoader(range(8), batch_size=2), rank=0,
        ...                              world_size=2, split_batches=False, even_batches=True)
        >>> mode.sampler.spec.world_size
        2
    """

    sampler: ShardedBatchSampler

    @property
    def ragged(self) -> bool:
        """Variable-size batches on several ranks: a round's batch sizes may differ."""
        spec = self.sampler.spec
        return spec.batch_size is None and spec.world_size > 1

    def length(self, loader: PreparedDataLoader) -> int:
        """This rank's batches in a whole epoch."""
        return len(self.sampler)

    def epoch_batches(self, loader: PreparedDataLoader, epoch: int, start: int) -> Iterator[Any]:
        """The ``DataLoader`` iteration over this rank's batches of ``epoch`` from ``start``."""
        override = _even_override()
        sampler = self.sampler
        sampler.epoch, sampler.skip = epoch, start
        sampler.even_batches = loader.even_batches if override is None else override
        loader.worker_seeds.apply(loader.generator, epoch)
        return DataLoader.__iter__(loader)

    def final_round(self) -> FinalRound | None:
        """The last round the sampler recorded."""
        return self.sampler.final_round

    def shuffle(self) -> Reseeder | None:
        """The sampler's reseeder when it owns a generator."""
        return shuffle_reseeder(self.sampler)

    def set_even(self, value: bool) -> None:
        """Change ``even_batches`` of the epoch being iterated (read at its end)."""
        self.sampler.even_batches = value


def sharded_sampler(
    loader: DataLoader[Any], *, rank: int, world_size: int, split_batches: bool,
    even_batches: bool,
) -> ShardedBatchSampler:
    """This rank's share of a seeded copy of ``loader``'s batch sampler (may broadcast a seed,
    a collective then).

    Raises:
        ConfigError: The loader does not batch (``batch_size=None`` with a sampler of single
            indices).

    Example:
        >>> sharded_sampler(DataLoader(range(6), batch_size=2), rank=1, world_size=2,
        ...                 split_batches=False, even_batches=True).spec.rank
        1
    """
    source: Any = loader.batch_sampler
    if source is None:
        if not isinstance(loader.sampler, BatchSampler):
            raise ConfigError(
                "prepare_data_loader() shards batches, but this loader has batch_size=None "
                "(no batching) and a sampler of single indices. Use `DataLoader(dataset, "
                "batch_size=...)` or pass a `BatchSampler` as `batch_sampler`."
            )
        source = loader.sampler
    batch_sampler, reseed = seeded_copy(source, loader.dataset, shared=True)
    size = getattr(batch_sampler, "batch_size", None)
    spec = ShardSpec(
        rank=rank,
        world_size=world_size,
        batch_size=size if isinstance(size, int) else None,
        drop_last=bool(getattr(batch_sampler, "drop_last", False)),
        split_batches=split_batches,
        even_batches=even_batches,
    )
    return ShardedBatchSampler(batch_sampler, spec, reseed)


def shard_mode(
    loader: DataLoader[Any], *, rank: int, world_size: int, split_batches: bool,
    even_batches: bool,
) -> tuple[ShardMode, dict[str, Any]]:
    """The shard mode of ``loader`` and the ``DataLoader`` arguments that read through it.

    Example:
        >>> mode, arguments = shard_mode(loader, rank=0, world_size=2, split_batches=False,
        ...                              even_batches=True)
        >>> arguments["batch_sampler"] is mode.sampler
        True
    """
    sampler = sharded_sampler(
        loader, rank=rank, world_size=world_size, split_batches=split_batches,
        even_batches=even_batches,
    )
    if loader.batch_sampler is None:  # a BatchSampler given as `sampler` (batch_size=None)
        arguments = {"dataset": loader.dataset, "sampler": sampler, "batch_size": None}
    else:
        arguments = {"dataset": loader.dataset, "batch_sampler": sampler}
    return ShardMode(sampler), arguments

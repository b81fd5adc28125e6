"""Stream mode: an iterable dataset that every rank reads, keeping its own elements.

The prepared loader's dataset is a :class:`~accel.data._stream_shard.StreamShard`; resuming reads
and drops the skipped elements (a stream cannot skip by index).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
from torch.utils.data import DataLoader

from accel.comm.metrics import FinalRound
from accel.data._epoch_seeds import Reseeder, stream_reseeder
from accel.data._loader_state import shuffle_reseeder
from accel.data._stream_shard import StreamShard

if TYPE_CHECKING:
    from accel.data._loader import PreparedDataLoader

__all__ = ["StreamMode", "stream_mode", "stream_shard"]


@attrs.define(eq=False)
class StreamMode:
    """A prepared loader's stream mode: its :class:`~accel.data._stream_shard.StreamShard`.

    Example:
        >>> mode, arguments = stream_mode(DataLoader(stream, batch_size=2), batch_size=2,
        ...                               rank=0, world_size=2, split_batches=False)
        >>> mode.stream.per_rank
        2
    """

    stream: StreamShard

    @property
    def ragged(self) -> bool:
        """Never: every rank's batch of a round has ``per_rank`` elements."""
        return False

    def length(self, loader: PreparedDataLoader) -> int:
        """This rank's batches in a whole epoch (``DataLoader``'s count over the shard)."""
        return DataLoader.__len__(loader)

    def epoch_batches(self, loader: PreparedDataLoader, epoch: int, start: int) -> Iterator[Any]:
        """The ``DataLoader`` iteration over this rank's batches of ``epoch`` from ``start``."""
        stream = self.stream
        stream.skip = start * stream.per_rank
        stream.reseed(epoch)
        loader.worker_seeds.apply(loader.generator, epoch)
        return DataLoader.__iter__(loader)

    def final_round(self) -> FinalRound | None:
        """The last round recorded in this process, else computed from ``len(dataset)``."""
        return self.stream.final_round or self.stream.expected_final_round()

    def shuffle(self) -> Reseeder | None:
        """The stream's reseeder when it owns the dataset's generator."""
        return shuffle_reseeder(self.stream)

    def set_even(self, value: bool) -> None:
        """Nothing to change: a stream's last round is always completed (unless ``drop_last``)."""


def stream_shard(
    dataset: Any, *, rank: int, world_size: int, per_rank: int, drop_last: bool
) -> StreamShard:
    """This rank's elements of ``dataset``, reseeded per epoch as every rank must read alike.

    Example:
        >>> list(stream_shard(range(5), rank=1, world_size=2, per_rank=2, drop_last=False))
        [2, 3, 1, 2]
    """
    stream = StreamShard(
        dataset, rank=rank, world_size=world_size, per_rank=per_rank, drop_last=drop_last
    )
    stream.reseed = stream_reseeder(dataset, shared=True)
    return stream


def stream_mode(
    loader: DataLoader[Any], *, batch_size: int, rank: int, world_size: int, split_batches: bool
) -> tuple[StreamMode, dict[str, Any]]:
    """The stream mode of ``loader`` and the ``DataLoader`` arguments that read through it.

    Example:
        >>> mode, arguments = stream_mode(loader, batch_size=4, rank=0, world_size=2,
        ...                               split_batches=True)
        >>> arguments["batch_size"]
        2
    """
    per_rank = batch_size // world_size if split_batches else batch_size
    drop_last = bool(loader.drop_last)
    stream = stream_shard(
        loader.dataset, rank=rank, world_size=world_size, per_rank=per_rank, drop_last=drop_last
    )
    arguments = {
        "dataset": stream, "batch_size": per_rank, "drop_last": drop_last,
    }
    return StreamMode(stream), arguments

"""The last round of an epoch and the small pieces every sharding rule shares.

A sharded epoch ends with a round that may be incomplete; every generator of
:mod:`accel.data._batch_sampler` and :mod:`accel.data._stream_shard` reports it as a
:class:`FinalRound` so that ``gather_for_metrics`` can drop exactly the padding. ``grow``
repeats the first round to pad a tiny dataset; ``skip_first`` skips the batches a resumed epoch
already yielded; ``dispatch_slice_size`` is the padded slice of a dispatched last batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import attrs

from accel.errors import ConfigError

__all__ = [
    "FinalRound", "Recorder", "dispatch_slice_size", "grow", "skip_first", "split_counts",
]

T = TypeVar("T")
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


def grow(pool: list[T], needed: int) -> list[T]:
    """Repeat ``pool`` until it holds at least ``needed`` items (for tiny datasets).

    Example:
        >>> grow([0, 1], 5)
        [0, 1, 0, 1, 0, 1, 0, 1]
    """
    while pool and len(pool) < needed:
        pool = pool + pool
    return pool


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

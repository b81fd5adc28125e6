"""The last round of an epoch and the small pieces every sharding rule shares.

A sharded epoch ends with a round that may be incomplete; every generator of
:mod:`accel.data._batch_sampler` and :mod:`accel.data._stream_shard` reports it as a
:class:`~accel.comm.metrics.FinalRound` so that ``gather_for_metrics`` can drop exactly the
padding. ``grow`` repeats the first round to pad a tiny dataset; ``skip_first`` skips the
batches a resumed epoch already yielded; ``dispatch_slice_size`` is the padded slice of a
dispatched last batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from accel.comm.metrics import FinalRound
from accel.errors import ConfigError

__all__ = [
    "Recorder", "dispatch_slice_size", "grow", "skip_first", "split_counts",
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

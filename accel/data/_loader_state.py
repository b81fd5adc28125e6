"""Loader states: the position and seeds a resumed loader continues from.

A prepared loader's ``state_dict()`` holds its position (epoch, batches yielded on each rank,
the world size and batch splitting it was counted with, whether the epoch's last batch was
yielded) and its seeds: the shuffle seed (the base of every epoch's permutation) and the base
of its worker seeds. With them a resumed
loader continues the same order whatever the new process's global RNG. A state without seeds
(saved before they were recorded) keeps the resumed loader's own seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from accel.data._batch_sampler import ShardedBatchSampler
from accel.data._epoch_seeds import Reseeder
from accel.data._stream_shard import StreamShard
from accel.errors import CheckpointError

__all__ = ["LoaderState", "loader_state", "read_loader_state", "rederive_position",
           "shuffle_reseeder"]

_POSITION_KEYS = ("epoch", "batches_yielded")
_SEED_KEYS = ("shuffle_seed", "worker_seed")


@attrs.frozen
class LoaderState:
    """A validated loader state, its position re-derived for this world size.

    ``None`` seeds mean "keep the loader's own" (a state without them).

    Example:
        >>> LoaderState(epoch=1, yielded=3, shuffle_seed=42, worker_seed=7)
        LoaderState(epoch=1, yielded=3, shuffle_seed=42, worker_seed=7, epoch_done=False)
    """

    epoch: int
    yielded: int
    shuffle_seed: int | None = None
    worker_seed: int | None = None
    epoch_done: bool = False
    """The position is the end of ``epoch`` (its last batch yielded): at another world size
    the loader's own epoch length, whatever batch count the saved world's padding made."""


def loader_state(
    epoch: int,
    yielded: int,
    *,
    world_size: int,
    split_batches: bool,
    shuffle_seed: int | None,
    worker_seed: int,
    epoch_done: bool = False,
) -> dict[str, int | None]:
    """What ``PreparedDataLoader.state_dict()`` returns (plain ints: exact in JSON).

    Example:
        >>> loader_state(1, 3, world_size=2, split_batches=False, shuffle_seed=5, worker_seed=5)
        {'epoch': 1, 'batches_yielded': 3, 'world_size': 2, 'split_batches': 0, \
'shuffle_seed': 5, 'worker_seed': 5, 'epoch_done': 0}
    """
    return {
        "epoch": epoch,
        "batches_yielded": yielded,
        "world_size": world_size,
        "split_batches": int(split_batches),
        "shuffle_seed": shuffle_seed,
        "worker_seed": worker_seed,
        "epoch_done": int(epoch_done),
    }


def read_loader_state(
    state_dict: Any, *, world_size: int, split_batches: bool
) -> LoaderState:
    """Check a loader state and re-derive its position for ``world_size`` processes.

    Raises:
        CheckpointError: it is not a loader state, or its position cannot be continued.

    Example:
        >>> read_loader_state({"epoch": 1, "batches_yielded": 4, "world_size": 2},
        ...                   world_size=4, split_batches=False)
        LoaderState(epoch=1, yielded=2, shuffle_seed=None, worker_seed=None, epoch_done=False)
    """
    saved: Mapping[str, Any] = state_dict if isinstance(state_dict, Mapping) else {}
    values: list[int] = []
    for key in _POSITION_KEYS:
        value = saved.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(
                f"a data loader position needs non-negative integers {list(_POSITION_KEYS)}, "
                f"got {state_dict!r}. Pass what `loader.state_dict()` returned."
            )
        values.append(value)
    seeds: list[int | None] = []
    for key in _SEED_KEYS:
        seed = saved.get(key)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise CheckpointError(
                f"a data loader state's {key!r} must be an integer or None, got {seed!r} in "
                f"{state_dict!r}. Pass what `loader.state_dict()` returned."
            )
        seeds.append(seed)
    epoch, yielded = values
    saved_world = saved.get("world_size", world_size)
    if not isinstance(saved_world, int) or isinstance(saved_world, bool) or saved_world < 1:
        raise CheckpointError(
            f"a data loader state's 'world_size' must be a positive integer, got "
            f"{saved_world!r}. Pass what `loader.state_dict()` returned."
        )
    saved_split = bool(saved.get("split_batches", split_batches))
    done = saved.get("epoch_done", 0)
    if done not in (0, 1):  # True/False too
        raise CheckpointError(
            f"a data loader state's 'epoch_done' must be 0 or 1, got {done!r}. Pass what "
            "`loader.state_dict()` returned."
        )
    done = bool(done)
    if saved_world != world_size or saved_split != split_batches:
        if done and saved_split == split_batches:  # a whole epoch: any world can continue it
            return LoaderState(epoch, 0, seeds[0], seeds[1], epoch_done=True)
        yielded = rederive_position(
            yielded, saved=(saved_world, saved_split), now=(world_size, split_batches)
        )
    return LoaderState(epoch, yielded, seeds[0], seeds[1], epoch_done=done)


def shuffle_reseeder(*holders: object) -> Reseeder | None:
    """The reseeder that shuffles a loader: the first sharded sampler or stream among
    ``holders`` whose reseeder owns a generator, else ``None`` (nothing to seed).

    Example:
        >>> shuffle_reseeder(sharded_batch_sampler, stream_shard)
        Reseeder(generator=<torch._C.Generator ...>, seed=7, targets=())
    """
    for holder in holders:
        reseed = holder.reseed if isinstance(holder, ShardedBatchSampler | StreamShard) else None
        if reseed is not None and reseed.generator is not None:
            return reseed
    return None


def rederive_position(yielded: int, *, saved: tuple[int, bool], now: tuple[int, bool]) -> int:
    """Batches already yielded per rank, for a position saved at another world size.

    ``saved`` and ``now`` are ``(world_size, split_batches)``. Without split batches, global
    batch ``i`` goes to rank ``i % world_size``, so ``yielded * saved_world`` global batches
    are done; that count must divide among the new ranks. With split batches every rank sees
    every global batch and the count carries over.

    Raises:
        CheckpointError: the position cannot be continued exactly.

    Example:
        >>> rederive_position(3, saved=(2, False), now=(3, False))
        2
    """
    saved_world, saved_split = saved
    world, split = now
    if saved_split != split:
        raise CheckpointError(
            f"The loader position was saved with split_batches={saved_split} and is loaded "
            f"with split_batches={split}: the positions do not correspond. Prepare the "
            "loader with the same `split_batches` to resume."
        )
    if split:
        return yielded
    consumed = yielded * saved_world
    if consumed % world:
        raise CheckpointError(
            f"The loader position ({yielded} batches on each of {saved_world} processes = "
            f"{consumed} batches) cannot be continued by {world} processes: {consumed} is not "
            f"a multiple of {world}. Resume with {saved_world} processes, or from a "
            "checkpoint at the start of an epoch."
        )
    return consumed // world

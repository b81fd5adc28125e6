"""Loader positions across world sizes: which batch a resumed rank continues from."""

from __future__ import annotations

from accel.errors import CheckpointError

__all__ = ["rederive_position"]


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

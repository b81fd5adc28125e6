"""Dispatched batches: rank 0 reads each round, broadcasts it, every rank keeps its slice.

Accelerate's ``DataLoaderDispatcher`` rule, used by :mod:`accel.data` for
``dispatch_batches=True``: a round is one batch of the original loader (``split_batches``) or
``world_size`` of them concatenated; rank ``r`` keeps rows ``[r * k, (r + 1) * k)``. A last
round that does not divide evenly is padded with the first samples of the epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from accel.comm.metrics import FinalRound
from accel.core.tree import first_non_tensor, map_tensors, tensor_leaves, zip_map_tensors
from accel.data._rounds import dispatch_slice_size, split_counts
from accel.errors import ConfigError, RemoteError

__all__ = ["concat_rounds", "dispatch_rounds"]

_END = object()


def concat_rounds(batches: Iterator[Any], group: int, *, drop_last: bool) -> Iterator[Any]:
    """Batches ``group`` at a time, concatenated on dim 0 (a short last group too, unless
    ``drop_last``).

    Raises:
        ConfigError: The batches of a group do not concatenate.

    Example:
        >>> [t.tolist() for t in concat_rounds(iter(torch.arange(5).split(2)), 2,
        ...                                    drop_last=False)]
        [[0, 1, 2, 3], [4]]
    """
    while True:
        parts = [batch for _, batch in zip(range(group), batches, strict=False)]
        if not parts or (len(parts) < group and drop_last):
            return
        if len(parts) == 1:
            yield parts[0]
        else:
            try:
                yield zip_map_tensors(lambda *ts: torch.cat(ts), *parts)
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    "dispatch_batches=True concatenates the batches of one round, but they "
                    f"differ in structure or shape ({exc}). Use "
                    "`prepare_data_loader(loader, split_batches=True)` or "
                    "`dispatch_batches=False`."
                ) from exc
        if len(parts) < group:
            return


def _skeleton(batch: Any) -> Any:
    found = first_non_tensor(batch)
    if found is not None:
        raise ConfigError(
            "dispatch_batches=True broadcasts tensors, but the batch holds "
            f"{type(found[1]).__name__} {found[1]!r:.60} at {found[0] or 'the top'}. Return "
            "tensors from the collate_fn, or use `prepare_data_loader(loader, "
            "dispatch_batches=False)`."
        )
    leaves = tensor_leaves(batch)
    if not leaves or leaves[0].ndim == 0:
        raise ConfigError(
            "dispatch_batches=True slices batches on their first dimension, but the batch "
            "has no tensor with one. Use `prepare_data_loader(loader, dispatch_batches=False)`."
        )
    return map_tensors(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), batch)


def _move_to(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device)


def _allocate(device: torch.device, meta: torch.Tensor) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=meta.dtype, device=device)


def _rows(lo: int, hi: int, clone: bool, tensor: torch.Tensor) -> torch.Tensor:
    rows = tensor[lo:hi]
    return rows.clone() if clone else rows


def _pad_cycling(count: int, tensor: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    index = torch.arange(count, device=source.device) % source.shape[0]
    return torch.cat([tensor, source[index]])


def dispatch_rounds(
    rounds: Iterator[Any],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    resume: bool,
    record: Callable[[FinalRound], None],
    reader: bool | None = None,
) -> Iterator[Any]:
    """This rank's slices of the rounds rank 0 reads. Every rank must iterate it together.

    Per round: one ``broadcast_object`` (the batch's shapes and whether it is the last) and
    one ``broadcast`` (the tensors). An error while reading on rank 0 is raised on every rank.

    Args:
        rounds: Rank 0: the global batches (see :func:`concat_rounds`); ignored elsewhere.
        rank: This process's rank.
        world_size: Number of processes.
        device: Where the batches are broadcast and returned.
        resume: The first round only provides the epoch's padding samples (resuming
            mid-epoch); it is not yielded.
        record: Called with the :class:`FinalRound` before the last slice is yielded.
        reader: Whether this process reads ``rounds`` and broadcasts them (global rank 0);
            default ``rank == 0``. Under tensor parallelism ``rank`` is the data-parallel
            rank, which several processes share.

    Example:
        >>> for piece in dispatch_rounds(rounds, rank=r, world_size=2, device=dev,
        ...                              resume=False, record=print): ...
    """
    from accel.comm.collectives import broadcast, broadcast_object

    current: Any = _END
    upcoming: Any = _END
    first = True
    pad_source: Any = None
    to_device = partial(_move_to, device)
    allocate = partial(_allocate, device)
    sliced_size = -1
    take = partial(_rows, 0, 0, False)
    reads = rank == 0 if reader is None else reader
    while True:
        header: Any = None
        failure: BaseException | None = None
        if reads:
            try:
                if first:
                    current = next(rounds, _END)
                upcoming = _END if current is _END else next(rounds, _END)
                if current is not _END:
                    header = (_skeleton(current), upcoming is _END, first and resume)
            except Exception as exc:  # sent to the other ranks first, then re-raised here
                failure = exc
                header = ("failed", f"{type(exc).__name__}: {exc}")
        header = broadcast_object(header)
        if header is None:
            return
        if header[0] == "failed":
            if failure is not None:
                raise failure
            raise RemoteError(f"rank 0 failed to read the batch to dispatch: {header[1]}")
        skeleton, last, padding_only = header
        first = False
        batch = map_tensors(to_device, current) if reads else map_tensors(allocate, skeleton)
        batch = broadcast(batch)
        if pad_source is None:
            pad_source = map_tensors(partial(_rows, 0, world_size, True), batch)
        if padding_only:
            if last:
                return
            current = upcoming
            continue
        observed = tensor_leaves(batch)[0].shape[0]
        per_rank = dispatch_slice_size(observed, world_size, last=last)
        if per_rank * world_size != observed:
            batch = zip_map_tensors(
                partial(_pad_cycling, per_rank * world_size - observed), batch, pad_source
            )
        if per_rank != sliced_size:
            sliced_size = per_rank
            take = partial(_rows, rank * per_rank, (rank + 1) * per_rank, False)
        piece = map_tensors(take, batch)
        if last:
            record(FinalRound(sizes=(per_rank,) * world_size,
                              real=split_counts(observed, per_rank, world_size)))
        yield piece
        if last:
            return
        current = upcoming

"""``accel.join_uneven_inputs``: train DDP models on ranks that see different numbers of batches.

A thin layer over ``torch.distributed.algorithms.Join``: ranks that run out of data early keep
answering the others' gradient all-reduces ("shadowing") until every rank is done, instead of
hanging the job.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable

from accel.comm.collectives import begin
from accel.core.scope import scope
from accel.core.state import state
from accel.errors import ArgumentTypeError

__all__ = ["join_uneven_inputs"]


def _as_joinables(joinables: object, *, single: bool = False) -> list[Joinable]:
    """The entries as a list; on one process (``single``) models and optimizers are accepted
    unwrapped (``prepare_model`` wraps nothing there), anything else is refused as on N."""
    if isinstance(joinables, Joinable | torch.nn.Module | torch.optim.Optimizer):
        items: list[Any] = [joinables]
    elif isinstance(joinables, Sequence) and not isinstance(joinables, str | bytes):
        items = list(joinables)
    else:
        items = [joinables]
    accepted = (Joinable, torch.nn.Module, torch.optim.Optimizer) if single else (Joinable,)
    for item in items:
        if not isinstance(item, accepted):
            raise ArgumentTypeError(
                f"accel.join_uneven_inputs() takes DDP-wrapped models (or other "
                f"torch.distributed.algorithms.Joinable objects), got {type(item).__name__} "
                f"{item!r:.60}. Pass the prepared model, e.g. "
                "`accel.join_uneven_inputs([model])`."
            )
    return items


@contextmanager
def _even_batches(even_batches: bool | None) -> Iterator[None]:
    """Override ``even_batches`` for the block: on the loaders being iterated now (those with
    an ``even_batches`` attribute) and, through ``scope().even_batches_override``, for loaders
    started in it."""
    if even_batches is None:
        yield
        return
    record = scope()
    previous_override = record.even_batches_override
    changed = [
        (loader, loader.even_batches)
        for loader in record.active_loaders
        if hasattr(loader, "even_batches")
    ]
    record.even_batches_override = even_batches
    for loader, _ in changed:
        loader.even_batches = even_batches
    try:
        yield
    finally:
        for loader, old in changed:
            loader.even_batches = old
        record.even_batches_override = previous_override


@contextmanager
def join_uneven_inputs(
    joinables: Joinable | Sequence[Joinable], *, even_batches: bool | None = None
) -> Iterator[None]:
    """Let ranks with fewer batches finish early while DDP training continues on the others.

    Every rank must enter it (it is a collective). Wraps ``torch.distributed.algorithms.Join``
    around the block for the DDP-wrapped models (or optimizers such as
    ``ZeroRedundancyOptimizer``) in ``joinables``; works on CPU (gloo) and GPU. On a single
    process it only runs the block.

    ``even_batches`` overrides the prepared data loaders' setting for the block: pass
    ``even_batches=False`` so loaders stop padding the last round with repeated samples
    (Join handles the uneven ends instead). It applies to prepared loaders being iterated when
    the block starts (switched, then restored on exit) and to iterations started inside it
    (prepared loaders read the override from the scope record).

    Args:
        joinables: a DDP model, or a list of models/optimizers implementing ``Joinable``.
        even_batches: ``True``/``False`` to override prepared loaders' ``even_batches``;
            ``None`` leaves them.

    Raises:
        TypeError: an entry is not ``Joinable`` (e.g. a model not wrapped in DDP).

    Example:
        >>> model = accel.prepare_model(model)  # DDP on several processes
        >>> with accel.join_uneven_inputs([model], even_batches=False):
        ...     for batch in loader:
        ...         loss = model(batch).sum()
        ...         accel.backward(loss)
        ...         optimizer.step()
    """
    begin("join_uneven_inputs", arrive="arrival_timeout")  # refuses inside a rank gate
    with _even_batches(even_batches):
        if state().world_size == 1:
            _as_joinables(joinables, single=True)  # refuse what N processes would refuse
            yield
            return
        with Join(_as_joinables(joinables)):
            yield

"""Every rank agrees on a failure, then raises: one collective, the same outcome on all ranks.

A step that may fail on some ranks only (reading a file, loading a state) must not leave the
others waiting in their next collective until a timeout. Each rank runs the step, turns its
error (if any) into one line with :func:`describe`, and the ranks exchange those lines with one
``gather_object``; every rank then sees every rank's error and raises alike.
:func:`agree_on_failure` wraps a block in that; :func:`rank_errors` is the exchange alone, for a
caller that decides itself what a failure means.

Example:
    >>> with agree_on_failure(lambda errors: CheckpointError(f"load failed: {errors}")):
    ...     model.load_state_dict(read(path))  # raises on every rank if it failed on any
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from accel.comm.collectives import gather_object
from accel.core.state import state
from accel.errors import AccelError

__all__ = ["agree_on_failure", "describe", "label_errors", "rank_errors"]


def describe(exc: BaseException) -> str:
    """An error as one line for the other ranks: accel's own message, else type and text.

    Example:
        >>> describe(OSError("disk full"))
        'OSError: disk full'
    """
    return str(exc) if isinstance(exc, AccelError) else f"{type(exc).__name__}: {exc}"


def label_errors(reports: Sequence[str | None]) -> list[str]:
    """The errors of a gathered list (rank order), ``"rank r: ..."`` on several processes.

    Example:
        >>> label_errors([None, "OSError: disk full"])  # on 2 processes
        ['rank 1: OSError: disk full']
    """
    several = state().world_size > 1
    return [f"rank {r}: {e}" if several else e for r, e in enumerate(reports) if e is not None]


def rank_errors(error: str | None) -> list[str]:
    """Every rank's error (``[]`` when none failed): one collective, the same on all ranks.

    Every rank must call it, with ``None`` when it did not fail.

    Example:
        >>> rank_errors(None if ok else describe(exc))
        ['rank 1: OSError: disk full']
    """
    return label_errors(gather_object(error))


@contextmanager
def agree_on_failure(
    fail: Callable[[str], BaseException],
    describe: Callable[[BaseException], str] = describe,
) -> Iterator[None]:
    """Run the block; if it raised on any rank, raise ``fail(errors)`` on every rank.

    Every rank must enter it (the exit is one collective, made whether the block raised or
    not). ``errors`` is every failed rank's error (see :func:`label_errors`), each distinct text
    once, joined by ``" | "``. An exception that is not an ``Exception`` (``KeyboardInterrupt``)
    leaves at once, without the collective.

    Example:
        >>> with agree_on_failure(lambda errors: CheckpointError(f"load failed: {errors}")):
        ...     apply(plan)
    """
    error: str | None = None
    try:
        yield
    except Exception as exc:  # every rank must hear of it, not wait for a timeout
        error = describe(exc)
    errors = rank_errors(error)
    if errors:
        raise fail(" | ".join(dict.fromkeys(errors))) from None

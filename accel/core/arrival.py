"""Arrival checks: a call every rank must make, entered by only some ranks, is named in time.

``save_state``, ``load_state``, ``wait_for_everyone``, ``main_process_first`` and
``join_uneven_inputs`` are collectives underneath but not per-step calls. Ported from
Accelerate, ``if accelerator.is_main_process: accelerator.save_state(...)`` leaves rank 0 in
``save_state`` and the other ranks in the next backward's all-reduce: a hang until the
collective timeout (30 minutes), with nothing said. At the entry of these calls each rank
announces itself in the process group's key-value store and waits, at most
``accel.state().arrival_timeout`` seconds (``timeout`` for ``wait_for_everyone``, whose purpose
is to wait), for the others. A rank that never comes is named on every rank that waits
(:class:`~accel.errors.ArrivalTimeoutError`); ranks that arrive at different calls are named
on each of them (:class:`~accel.errors.CollectiveMismatchError`). The raising rank leaves at
once (no collective on that path), so the launcher's fail-fast ends the peers blocked
elsewhere. Only the store is used, never a collective; per-step collectives (``gather``,
``reduce``, the backward's all-reduce) are untouched.

Each rank numbers its own checked calls with a counter in the store (so numbering goes on
across ``distributed()`` blocks that share a process group); at call ``n`` it writes
``accel/arrive/n/rank/<rank>`` = the call's name, counts the call's name and the arrivals, and
the last to arrive writes ``.../done``. Once every rank passed call ``n``, call ``n - 1``'s keys
are deleted: a run leaves a handful of small keys, never one per call.

Example:
    >>> check_arrival(accel.state(), "save_state", "arrival_timeout")  # on every rank
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch.distributed as dist

from accel.core.state import ProcessState
from accel.errors import ArrivalTimeoutError, CollectiveMismatchError

__all__ = ["ArrivalBound", "check_arrival"]

ArrivalBound = Literal["arrival_timeout", "timeout"]
"""The state's field that bounds the wait: ``arrival_timeout``, or the collective ``timeout``
for a call whose purpose is waiting (``wait_for_everyone``)."""

_PREFIX = "accel/arrive"
_FIX_ARGS = {"save_state": "directory, ...", "load_state": "directory, ..."}
_STORE_ERRORS = (RuntimeError, ValueError, OSError)  # torch's DistError is a RuntimeError


def _store() -> Any:
    """The default process group's key-value store, or ``None`` where torch gives none."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except _STORE_ERRORS:  # a backend without a store (MPI): no check, as before
        return None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _calls_of(store: Any, key: str, ranks: list[int]) -> dict[str, list[int]]:
    """Which call each of ``ranks`` announced at ``key`` (error paths only)."""
    calls: dict[str, list[int]] = {}
    for rank in ranks:
        try:
            name = store.get(f"{key}/rank/{rank}").decode()
        except _STORE_ERRORS:
            name = "?"
        calls.setdefault(name, []).append(rank)
    return calls


def _shown(calls: dict[str, list[int]]) -> str:
    return ", ".join(f"{_ranks(ranks)}: accel.{name}()" for name, ranks in calls.items())


def _fix(op: str) -> str:
    return f"`accel.{op}({_FIX_ARGS.get(op, '')})`"


_CAUSE = (
    "The usual cause: the call sits inside `if accel.is_main_process:` (Accelerate's "
    "`if accelerator.is_main_process:` ported as it was), a decorator of your own that runs "
    "it on one rank, or another branch that some ranks skip, so the other ranks went on to "
    "their next collective (e.g. the next backward's all-reduce) and the job would hang."
)


def _never_arrived(
    store: Any, st: ProcessState, op: str, n: int, bound: ArrivalBound, seconds: float
) -> ArrivalTimeoutError:
    key = f"{_PREFIX}/{n}"
    arrived: list[int] = []
    for rank in range(st.world_size):
        try:
            if store.check([f"{key}/rank/{rank}"]):
                arrived.append(rank)
        except _STORE_ERRORS:  # the store's host has gone: only this rank is known
            arrived = [st.rank]
            break
    missing = [rank for rank in range(st.world_size) if rank not in arrived]
    suggested = max(600, int(seconds) * 4)
    extra = " (it writes from the main process by itself)" if op == "save_state" else ""
    return ArrivalTimeoutError(
        f"accel.{op}() must be called on every rank, but ranks {missing} never arrived within "
        f"{bound}={seconds!r}s (ranks {arrived} did: {_shown(_calls_of(store, key, arrived))}; "
        f"call #{n} of those every rank must make). {_CAUSE} Call it on every rank, outside the "
        f"`if`: {_fix(op)}{extra}. If the missing ranks are only slower (work that some ranks "
        f"do first, e.g. an evaluation on the main process), raise the bound: "
        f"`accel.distributed({bound}={suggested})` or `ACCEL_{bound.upper()}={suggested}`."
    )


def _mismatch(store: Any, st: ProcessState, n: int) -> CollectiveMismatchError:
    calls = _calls_of(store, f"{_PREFIX}/{n}", list(range(st.world_size)))
    first = next(name for name, ranks in calls.items() if 0 in ranks)
    if first == "wait_for_everyone":  # the gated call is the other one
        first = next((name for name in calls if name != first), first)
    return CollectiveMismatchError(
        f"Ranks are in different calls that every rank must make (call #{n}): "
        f"{_shown(calls)}. {_CAUSE} Make every rank make the same calls in the same order, "
        f"e.g. {_fix(first)} on every rank, outside the `if`."
    )


def _delete(store: Any, key: str) -> None:
    try:
        store.delete_key(key)
    except (*_STORE_ERRORS, NotImplementedError):  # a store that cannot delete keeps it
        pass


def _forget(store: Any, st: ProcessState, n: int) -> None:
    """Delete call ``n``'s keys: every rank has passed it (they are all at call ``n + 1``)."""
    if n < 0:
        return
    key = f"{_PREFIX}/{n}"
    if st.rank == 0:  # the shared keys: rank 0 deletes them, each rank its own
        try:
            name = store.get(f"{key}/rank/0").decode()
        except _STORE_ERRORS:
            name = None
        for shared in ("total", "done", *(() if name is None else (f"op/{name}",))):
            _delete(store, f"{key}/{shared}")
    _delete(store, f"{key}/rank/{st.rank}")


def _wait_for(store: Any, key: str, seconds: float) -> bool:
    """Whether ``key`` appeared within ``seconds``: checked at once, then after pauses that
    double from 0.2 ms to 50 ms. A FileStore's own ``wait`` polls every 10 ms, which made each
    checked call cost ~10 ms when the ranks arrive together; this costs a few store reads."""
    deadline = time.monotonic() + seconds
    pause = 0.0002
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
    return True


def check_arrival(st: ProcessState, op: str, bound: ArrivalBound) -> None:
    """Wait until every rank arrived at this call; name the ranks that did not, or differ.

    Every rank must call it, at the entry of ``accel.<op>()``; a no-op on one process and
    where the process group has no key-value store. The wait lasts at most ``st.<bound>``
    seconds (and never longer than ``st.timeout``).

    Raises:
        ArrivalTimeoutError: some ranks did not arrive in time (named, with what the others
            called and the usual cause).
        CollectiveMismatchError: the ranks arrived at different calls (each named).

    Example:
        >>> check_arrival(accel.state(), "load_state", "arrival_timeout")  # on every rank
    """
    if st.world_size == 1:
        return
    store = _store()
    if store is None:
        return
    seconds = min(float(getattr(st, bound)), st.timeout)
    n = int(store.add(f"{_PREFIX}/count/{st.rank}", 1)) - 1  # this rank's calls so far
    key = f"{_PREFIX}/{n}"
    store.set(f"{key}/rank/{st.rank}", op)  # before the counts: read by whoever names us
    store.add(f"{key}/op/{op}", 1)
    if int(store.add(f"{key}/total", 1)) == st.world_size:
        store.set(f"{key}/done", "1")
    try:
        arrived = _wait_for(store, f"{key}/done", seconds)
    except _STORE_ERRORS:  # the store's host has gone
        arrived = False
    if not arrived:
        raise _never_arrived(store, st, op, n, bound, seconds) from None
    if int(store.add(f"{key}/op/{op}", 0)) != st.world_size:
        raise _mismatch(store, st, n)
    _forget(store, st, n - 1)

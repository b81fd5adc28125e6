"""The liveness watch: on a job of several machines, a lost machine is named within seconds.

gloo notices a dead peer only when a socket says so: a machine whose processes are killed
resets its connections (seconds), but a machine whose link is cut says nothing, and every
survivor waits in its collective for the 30-minute ``timeout``. So, in each process of a job
spanning several machines, ``accel.distributed()`` runs a :class:`Watch`: a daemon thread with
its own connection to the job's key-value store (the TCP store on machine 0 that the launcher
set up; never the main thread's socket) that every ``heartbeat_interval`` seconds

* adds 1 to this rank's stamp counter (``accel/live/<n>/beat/<rank>``), and
* reads every rank's counter: a machine is heard when any of its ranks' counters moved.

A machine none of whose ranks was heard for ``liveness_timeout`` seconds is lost; so is machine
0 (the store's host) from a machine whose store requests got no answer for as long (its link is
cut, from this side). Liveness, not progress, is watched: a rank busy in a long save, a slow
loader or a first compile keeps stamping (the thread runs whenever the main thread releases the
GIL, which Python code does every few milliseconds and torch's kernels and file writes do while
they run).

A lost machine cannot be raised in the main thread, which is usually blocked inside a gloo
collective, so the watch writes :class:`~accel.errors.MachineLostError` (hostname, node rank,
ranks, seconds unheard, the option that bounds it) to stderr and to the worker's failure record
(``accel launch`` reports it), then ends the process with exit code 1 (``os._exit``): torchrun's
agent stops the other local workers, or restarts them under ``--max-restarts``.

Where gloo itself raises first (a killed machine resets its connections), the
error's ``[198.18.9.2]:51936`` is translated to the machine at that address
(:meth:`Watch.explain`, raised by ``distributed()`` from gloo's error), using the records every
rank publishes at the start (:mod:`accel.core.machines`).

The decision is pure (:class:`Hearing`, :func:`hear`, :func:`verdict`) and takes the time as an
argument, so it is tested with a fake clock.

Example:
    >>> watch = start_watch(accel.state(), liveness_bounds(LaunchEnv()), store_address="n0:29500")
    >>> watch.stop(clean=True)  # after the block's final barrier
"""

from __future__ import annotations

import contextvars
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from accel.core.env import LaunchEnv
from accel.core.failure_record import write_failure_record
from accel.core.machines import (
    Machine,
    Peer,
    decode_peer,
    describe_machine,
    encode_peer,
    failed_address,
    machines_at,
    machines_of,
    this_peer,
)
from accel.core.setting_values import validate_setting
from accel.core.settings import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_LIVENESS_TIMEOUT_S
from accel.core.state import ProcessState
from accel.errors import ConfigError, MachineLostError

__all__ = [
    "Hearing",
    "LivenessBounds",
    "Watch",
    "hear",
    "liveness_bounds",
    "start_watch",
    "verdict",
]

_STORE_ERRORS = (RuntimeError, ValueError, OSError)  # torch's DistError is a RuntimeError
_LEFT = -1  # a rank's counter once it left its block cleanly: no longer watched


@attrs.frozen
class LivenessBounds:
    """The watch's bounds: seconds between stamps, and unheard seconds before a machine is
    lost (``timeout == 0``: no watch)."""

    interval: float = DEFAULT_HEARTBEAT_INTERVAL_S
    timeout: float = DEFAULT_LIVENESS_TIMEOUT_S

    @property
    def on(self) -> bool:
        """Whether a watch runs."""
        return self.timeout > 0


def liveness_bounds(
    env: LaunchEnv, *, heartbeat_interval: float | None = None,
    liveness_timeout: float | None = None,
) -> LivenessBounds:
    """The bounds: the argument, else ``ACCEL_HEARTBEAT_INTERVAL`` / ``ACCEL_LIVENESS_TIMEOUT``
    or the config file (both in ``env``), else 1 s and 10 s.

    Raises:
        ConfigError: a value that is not a number in range, or a timeout under two intervals.

    Example:
        >>> liveness_bounds(LaunchEnv(), liveness_timeout=30)
        LivenessBounds(interval=1.0, timeout=30.0)
    """
    def pick(key: str, given: float | None, held: float | None, default: float) -> float:
        if given is not None:
            return float(validate_setting(key, given, "accel.distributed()"))  # type: ignore[arg-type]
        return default if held is None else float(held)

    interval = pick("heartbeat_interval", heartbeat_interval, env.heartbeat_interval,
                    DEFAULT_HEARTBEAT_INTERVAL_S)
    timeout = pick("liveness_timeout", liveness_timeout, env.liveness_timeout,
                   DEFAULT_LIVENESS_TIMEOUT_S)
    if timeout < 0:
        raise ConfigError(
            f"liveness_timeout={timeout!r} must be a number of seconds >= 0 (0: no watch), "
            "e.g. `accel.distributed(liveness_timeout=30)` or `ACCEL_LIVENESS_TIMEOUT=30`."
        )
    if 0 < timeout < 2 * interval:
        raise ConfigError(
            f"liveness_timeout={timeout!r} must be at least twice heartbeat_interval="
            f"{interval!r} (a machine is lost after that many seconds without a stamp), or 0 to "
            "turn the watch off; e.g. `accel.distributed(liveness_timeout="
            f"{max(10, 4 * interval):g}, heartbeat_interval={interval:g})`."
        )
    return LivenessBounds(interval=interval, timeout=timeout)


@attrs.frozen
class Hearing:
    """What one watcher last heard: each rank's counter, when each machine was last heard
    (a counter of its moved), and when the store last answered (monotonic seconds)."""

    counts: Mapping[int, int]
    heard: Mapping[int, float]
    answered: float
    left: frozenset[int] = frozenset()

    @classmethod
    def first(cls, now: float, nodes: Mapping[int, int]) -> Hearing:
        """At the watch's start: every machine counts as just heard.

        Example:
            >>> Hearing.first(5.0, {0: 0, 1: 1}).heard
            {0: 5.0, 1: 5.0}
        """
        return cls(counts={}, heard=dict.fromkeys(sorted(set(nodes.values())), now),
                   answered=now)


def hear(hearing: Hearing, counts: Mapping[int, int | None], nodes: Mapping[int, int],
         now: float) -> Hearing:
    """The hearing after the store answered at ``now`` with these counters.

    Args:
        hearing: the hearing before.
        counts: each rank's counter (``None``: not stamped yet; -1: left its block cleanly).
        nodes: each rank's node rank.
        now: when the store answered (monotonic seconds).

    Example:
        >>> h = hear(Hearing.first(0.0, {0: 0, 1: 1}), {0: 3, 1: 4}, {0: 0, 1: 1}, 2.0)
        >>> h.heard[1]
        2.0
    """
    heard = dict(hearing.heard)
    left = set(hearing.left)
    for rank, count in counts.items():
        if count is None or count == hearing.counts.get(rank):
            continue
        if count == _LEFT:
            left.add(rank)
        heard[nodes[rank]] = now
    known = {rank: count for rank, count in counts.items() if count is not None}
    return Hearing(counts={**hearing.counts, **known}, heard=heard, answered=now,
                   left=frozenset(left))


def verdict(hearing: Hearing, now: float, timeout: float, nodes: Mapping[int, int], *,
            own_node: int, store_node: int,
            interval: float = DEFAULT_HEARTBEAT_INTERVAL_S) -> tuple[int, float, bool] | None:
    """The machine to declare lost at ``now``: ``(node rank, seconds unheard, whether it is
    the store's host unreachable from here)``, or ``None``.

    The store unanswered for ``timeout`` seconds names the store's machine; otherwise the
    machine (other than this one) unheard the longest past ``timeout``, among those with a
    rank still in its block. When that machine is the store's and the store has not answered
    for two heartbeat ``interval`` s either, it is the store's machine that is unreachable
    (its last stamp can lag the store's last answer by an interval, so its silence passes
    ``timeout`` first).

    Example:
        >>> h = Hearing.first(0.0, {0: 0, 1: 1})
        >>> verdict(h, 12.0, 10.0, {0: 0, 1: 1}, own_node=0, store_node=0)
        (1, 12.0, False)
    """
    if timeout <= 0:
        return None
    if now - hearing.answered >= timeout and store_node != own_node:
        return store_node, now - hearing.answered, True
    watched = {node for rank, node in nodes.items() if rank not in hearing.left}
    silent = [(now - hearing.heard.get(node, now), node) for node in watched
              if node != own_node and now - hearing.heard.get(node, now) >= timeout]
    if not silent:
        return None
    seconds, node = max(silent)
    unanswered = now - hearing.answered
    if node == store_node and unanswered >= 2 * interval:
        return node, unanswered, True
    return node, seconds, False


def _count(raw: bytes) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None


def _end_process(error: MachineLostError) -> None:
    """Report ``error`` (stderr, the failure record) and end this process with exit code 1."""
    name = threading.current_thread().name
    text = (f"Raised by accel's liveness watch (thread {name!r}; the main thread may be blocked "
            f"in a collective):\n{type(error).__module__}.{type(error).__name__}: {error}\n")
    try:
        write_failure_record(error, text)
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    finally:
        os._exit(1)


class Watch:
    """One process's heartbeat and watch over the job's machines (a daemon thread).

    Args:
        store: a key-value store client of this watch's own (not the main thread's).
        rank: this process's rank; ``world_size``: the job's ranks.
        node_rank: this process's machine.
        bounds: the interval and the timeout.
        store_address: ``host:port`` of the store, for messages.
        clock: monotonic seconds (a fake one in tests).
        on_lost: what a lost machine does (default: report it and ``os._exit(1)``).
    """

    def __init__(
        self, store: Any, *, rank: int, world_size: int, node_rank: int,
        bounds: LivenessBounds, store_address: str, store_host: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_lost: Callable[[MachineLostError], None] = _end_process,
    ) -> None:
        self._store = store
        self.rank, self.world_size, self.node_rank = rank, world_size, node_rank
        self.bounds = bounds
        self._address = store_address
        self._store_host = store_host
        self._clock = clock
        self._on_lost = on_lost
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        self._leave = False
        self._nodes: dict[int, int] = {}
        self.machines: tuple[Machine, ...] = ()
        self._prefix = ""
        self.hearing = Hearing.first(clock(), {})

    # -- the parts in the main thread -------------------------------------------------------

    def publish(self, peer: Peer) -> None:
        """Write this rank's record and first stamp (main thread, before :meth:`start`)."""
        generation = int(self._store.add(f"accel/live/blocks/{self.rank}", 1))
        self._prefix = f"accel/live/{generation}"
        self._store.set(f"{self._prefix}/who/{self.rank}", encode_peer(peer))
        self._store.add(self._beat_key(self.rank), 1)
        self.hearing = Hearing.first(self._clock(), {})

    def start(self) -> None:
        """Start the two daemon threads (they capture the caller's context): one talks to
        the store, the other judges. A store request to a machine whose link is cut can
        block for good (torch's client retries past its timeout), so the judge never waits
        on one: it reads the time of the last answer."""
        for name, loop in (("io", self._exchange_loop), ("judge", self._judge_loop)):
            thread = threading.Thread(
                target=contextvars.copy_context().run, args=(loop,), daemon=True,
                name=f"accel-liveness-{name}-{self.rank}",
            )
            self._threads.append(thread)
            thread.start()

    def stop(self, *, clean: bool) -> None:
        """Stop the threads. ``clean`` (after the block's final barrier): the store thread
        first marks this rank as left, so that no watcher still running takes it for lost
        (waited for at most ``heartbeat_interval`` + 2 s: a store that does not answer
        cannot hold the block's exit). A failing block waits a moment and marks nothing."""
        self._leave = clean
        self._stopped.set()
        wait = self.bounds.interval + 2.0 if clean else 0.2
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def explain(self, error: BaseException) -> MachineLostError | None:
        """The machine behind a collective's transport error (gloo's ``Read error
        [198.18.9.2]:51936: Connection reset by peer``), as a :class:`MachineLostError`;
        ``None`` when the error is no such failure or names no other machine."""
        seen: set[int] = set()
        link: BaseException | None = error
        found = None
        while link is not None and id(link) not in seen and found is None:
            seen.add(id(link))
            found = failed_address(str(link))
            link = link.__cause__ or link.__context__
        if found is None:
            return None
        address, why = found
        lost = machines_at(address, self.machines, self.node_rank)
        if not lost:
            return None
        now = self._clock()
        heard = "; ".join(
            f"{describe_machine(m)} last heard {now - self.hearing.heard.get(m.node_rank, now):.1f}"
            "s ago" for m in lost)
        which = describe_machine(lost[0]) if len(lost) == 1 else (
            "one of " + ", ".join(describe_machine(m) for m in lost))
        return MachineLostError(
            f"Lost {which}: rank {self.rank} (on machine {self.node_rank}) lost its collective "
            f"connection to {address} ({why}): that machine's processes ended, killed, crashed "
            f"or stopped by their launcher after an error there (its own output says which). "
            f"({heard}.) The job cannot go on without it: restart it (or let "
            "`accel launch --max-restarts N` do it) and resume from the last checkpoint."
        )

    # -- the thread ----------------------------------------------------------------------------

    def _beat_key(self, rank: int) -> str:
        return f"{self._prefix}/beat/{rank}"

    def _read_machines(self) -> None:
        keys = [f"{self._prefix}/who/{rank}" for rank in range(self.world_size)]
        if not self._store.check(keys):
            return
        peers = [p for p in (decode_peer(raw) for raw in self._store.multi_get(keys)) if p]
        self._nodes = {p.rank: p.node_rank for p in peers}
        self.machines = machines_of(peers)
        self.hearing = Hearing.first(self._clock(), self._nodes)  # from here on, watched

    def _store_node(self) -> int:
        """The machine the store lives on: the one at its host's address, else machine 0."""
        if self._store_host:
            host = self._store_host
            having = [m for m in self.machines if host in m.addresses or host == m.hostname]
            if len(having) == 1:
                return having[0].node_rank
        return 0

    def tick(self) -> MachineLostError | None:
        """One round (both threads' work, in tests): stamp, read, decide."""
        self.exchange()
        return self.judge()

    def exchange(self) -> None:
        """Stamp this rank and read every rank's counter (the store thread's round)."""
        try:
            self._store.add(self._beat_key(self.rank), 1)
            if not self._nodes:
                self.hearing = attrs.evolve(self.hearing, answered=self._clock())
                self._read_machines()
            if self._nodes:
                ranks = sorted(self._nodes)
                raw = self._store.multi_get([self._beat_key(r) for r in ranks])
                counts = {r: _count(v) for r, v in zip(ranks, raw, strict=True)}
                self.hearing = hear(self.hearing, counts, self._nodes, self._clock())
        except _STORE_ERRORS:
            pass  # unanswered: the hearing keeps the last answer's time

    def judge(self) -> MachineLostError | None:
        """The loss to declare now, from the last hearing (the judging thread's round)."""
        if not self._nodes:  # no directory yet: only the store's silence can be judged
            silent = self._clock() - self.hearing.answered
            if self.node_rank != 0 and silent >= self.bounds.timeout:
                return self._lost(0, silent, store=True)
            return None
        found = verdict(self.hearing, self._clock(), self.bounds.timeout, self._nodes,
                        own_node=self.node_rank, store_node=self._store_node(),
                        interval=self.bounds.interval)
        return None if found is None else self._lost(*found[:2], store=found[2])

    def _lost(self, node: int, seconds: float, *, store: bool) -> MachineLostError:
        machine = next((m for m in self.machines if m.node_rank == node), None)
        who = describe_machine(machine) if machine else f"machine {node} (node rank {node})"
        bound = self.bounds.timeout
        fix = (f"If that machine is only slow (e.g. a native call holding Python's GIL for "
               f"that long), raise the bound: `accel.distributed(liveness_timeout="
               f"{max(60, int(bound) * 4)})`, `accel launch --liveness-timeout "
               f"{max(60, int(bound) * 4)}` or `ACCEL_LIVENESS_TIMEOUT={max(60, int(bound) * 4)}`.")
        if store:
            what = (f"Lost {who}, which holds the job's store at {self._address}: it has not "
                    f"answered rank {self.rank} (on machine {self.node_rank}) for "
                    f"{seconds:.1f}s (liveness_timeout={bound:g}s): its launcher died, or the "
                    "network link between the machines is down.")
        else:
            what = (f"Lost {who}: none of its processes was heard from for {seconds:.1f}s "
                    f"(liveness_timeout={bound:g}s, heartbeat_interval="
                    f"{self.bounds.interval:g}s; watched by rank {self.rank} on machine "
                    f"{self.node_rank}): its processes died or stopped, or the network link to "
                    "it is down.")
        return MachineLostError(
            f"{what} Rank {self.rank} ends now (exit code 1) so that its launcher stops the "
            "job, or restarts it under `--max-restarts`, instead of waiting in a collective "
            f"until its `timeout`. {fix}"
        )

    def _exchange_loop(self) -> None:
        while not self._stopped.wait(self.bounds.interval):
            self.exchange()
        if self._leave:
            try:
                self._store.set(self._beat_key(self.rank), str(_LEFT))
            except _STORE_ERRORS:
                pass

    def _judge_loop(self) -> None:
        while not self._stopped.wait(self.bounds.interval):
            lost = self.judge()
            if lost is not None and not self._stopped.is_set():
                self._on_lost(lost)
                return


def start_watch(
    st: ProcessState, bounds: LivenessBounds, *, store_host: str | None,
    store_port: int | None,
) -> Watch | None:
    """Start this process's watch when the job spans several machines (``st.num_nodes > 1``)
    and the bounds turn it on; ``None`` otherwise (one machine pays nothing) or where the
    process group has no TCP store.

    Example:
        >>> watch = start_watch(accel.state(), liveness_bounds(LaunchEnv()),
        ...                     store_host="node0", store_port=29500)
    """
    if st.num_nodes <= 1 or st.world_size <= 1 or not bounds.on:
        return None
    store = _own_store(bounds.timeout)
    if store is None:
        return None
    watch = Watch(store, rank=st.rank, world_size=st.world_size, node_rank=st.node_rank,
                  bounds=bounds, store_address=f"{store_host}:{store_port}",
                  store_host=store_host)
    try:
        watch.publish(this_peer(st.rank, st.node_rank, store_host))
    except _STORE_ERRORS:
        return None
    watch.start()
    return watch


def _own_store(timeout: float) -> Any:
    """A new connection to the default process group's store, its requests bounded by
    ``timeout`` seconds; ``None`` where torch gives no store that can be cloned."""
    import torch.distributed as dist

    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        store = getter().clone() if getter is not None else None
        if store is not None:
            store.set_timeout(datetime.timedelta(seconds=timeout))
        return store
    except (*_STORE_ERRORS, AttributeError, NotImplementedError):
        return None

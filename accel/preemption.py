"""``stop_requested()``: agree on every rank, at the same call, that a stop signal arrived.

Schedulers (SLURM, Kubernetes) and ``accel launch`` send SIGTERM, SIGINT or SIGUSR1 some time
before they kill a job. The first call of :func:`stop_requested` in a ``distributed()`` block
installs handlers for those signals (main thread only) that merely note the signal; the block's
end puts the previous handlers back.

Agreement without a blocking collective per step: every so many calls, each rank starts an
asynchronous all-reduce (MAX) of ``[signal seen, -proposed interval]`` and reads it a fixed
number of calls later, when it has long completed. Ranks start and read it at the same call
indices, so they all see the same flag at the same call; the interval (how many calls until the
next read) travels in the same all-reduce, so every rank uses the same one. It adapts so that a
collective happens about every :data:`_PERIOD_S` seconds of loop time, but at least every
:data:`_MAX_INTERVAL` calls: a stop is seen at most about two intervals after the signal.
"""

from __future__ import annotations

import signal
import threading
import time
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from accel.core.exit_refs import keep_until_exit
from accel.core.scope import ScopeSlot, at_block_exit
from accel.core.state import current_gate, has_active_state, state
from accel.errors import GatedCollectiveError, NotDistributedError

__all__ = ["stop_requested"]

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_PERIOD_S = 0.02  # aim for one agreement collective per this much loop time
_MAX_INTERVAL = 256  # but at least one every this many calls
_REPEAT_WINDOW_S = 2.0  # a signal this soon after the first is the same request, delivered twice

_Handler = Callable[[int, FrameType | None], Any] | int | None


class _Watch:
    """The stop state of one ``distributed()`` block (kept in its scope record)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.signum: int | None = None  # the first stop signal this process received
        self.first_at = 0.0
        self.previous: dict[int, _Handler] = {}
        self.installed = False
        self.warned = False
        self.decided = False
        self.calls_left = 0  # calls until the pending all-reduce is read (0: read now)
        self.interval = 1
        self.issued_at = 0.0
        self.work: Any = None
        self.buffer = torch.zeros(2, dtype=torch.int64)
        self.group: Any = None  # a gloo group of our own when the default group is not gloo
        self.own_group = False

    # -- signals ------------------------------------------------------------------------------

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            if not self.warned:
                self.warned = True
                warnings.warn(
                    "accel.stop_requested() was called outside the main thread, where Python "
                    "cannot install signal handlers: SIGTERM/SIGINT/SIGUSR1 keep their current "
                    "behaviour in this process until it is called from the main thread. Call "
                    "`accel.stop_requested()` once in the main thread before starting the "
                    "training thread.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self.on_signal)
        self.installed = True

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
            return
        if now - self.first_at < _REPEAT_WINDOW_S:
            return  # e.g. a scheduler signalling the launcher and its workers at once
        # a second request: what would have happened without accel (the process ends)
        previous = self.previous.get(signum)
        if previous is None:
            previous = signal.SIG_DFL
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signum)

    def restore(self) -> None:
        if not self.installed:
            return
        for sig, previous in self.previous.items():
            try:
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
            except ValueError:  # the block ended outside the main thread: cannot restore
                return
        self.installed = False

    # -- agreement ----------------------------------------------------------------------------

    def poll(self) -> bool:
        if self.decided:
            return True
        if not self.installed:
            self.install()
        if self.world_size == 1:
            self.decided = self.signum is not None
            return self.decided
        self.calls_left -= 1
        if self.calls_left > 0:
            return False
        return self.agree()

    def agree(self) -> bool:
        if self.work is not None:
            self.work.wait()
            flag, negative_interval = self.buffer.tolist()
            self.work = None
            if flag:
                self.decided = True
                return True
            self.interval = -int(negative_interval)
        self.issue()
        self.calls_left = self.interval
        return False

    def issue(self) -> None:
        now = time.perf_counter()
        proposal = 1
        if self.issued_at:
            per_call = (now - self.issued_at) / self.interval
            proposal = int(_PERIOD_S / per_call) if per_call > 0 else _MAX_INTERVAL
            proposal = max(1, min(_MAX_INTERVAL, proposal))
        self.issued_at = now
        if self.group is None:
            self.group = _agreement_group(self)
        flag = 1 if self.signum is not None else 0
        self.buffer = torch.tensor([flag, -proposal], dtype=torch.int64)
        # smallest interval wins: the rank with the slowest calls keeps the stop prompt
        self.work = dist.all_reduce(
            self.buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )

    def finish(self, *, failed: bool) -> None:
        """Wait for the pending all-reduce (clean exit only), restore handlers, free the group."""
        try:
            if self.work is not None:
                # never freed by gloo's worker thread while the interpreter ends (exit_refs)
                keep_until_exit(self.work, self.buffer)
                if not failed:
                    try:
                        self.work.wait()
                    except RuntimeError:  # a peer already left: nothing left to agree with
                        pass
            self.work = None
            if self.own_group and not failed:
                dist.destroy_process_group(self.group)
        finally:
            self.restore()


_WATCH: ScopeSlot[_Watch] = ScopeSlot("accel.preemption stop watch")


def _agreement_group(watch: _Watch) -> Any:
    """The group the flag travels in: the default one on gloo, else a gloo group of our own.

    A CPU tensor in a gloo group is read without synchronising a CUDA stream (reading a flag
    reduced by NCCL would wait for every kernel queued before it). Creating it is a collective:
    every rank does it at its first agreement, i.e. at the same call.
    """
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    watch.own_group = True
    return dist.new_group(backend="gloo")


def stop_requested() -> bool:
    """Whether any rank received SIGTERM, SIGINT or SIGUSR1: the same answer on every rank.

    Call it on every rank at the same place in the loop (once per step, say). The first call
    installs handlers for those signals (in the main thread; the ``distributed()`` block's end
    restores the previous ones) that only note the signal. Once any rank has received one, every
    rank returns ``True`` at the same call, at most about two agreement intervals later (an
    interval is about 20 ms of loop time, at most 256 calls, at least one call), and from then on.
    There is no blocking collective per call: an asynchronous all-reduce started at one call is
    read some calls later. On one process no collective is made. A second signal more than 2 s
    after the first gets the behaviour it had before the first call (SIGTERM and SIGUSR1 end the
    process, SIGINT raises ``KeyboardInterrupt``); repeats within 2 s count as one request.

    Returns:
        True once a stop was requested on any rank, at the same call on every rank.

    Raises:
        NotDistributedError: called outside a ``with accel.distributed():`` block, or on
            several processes without a process group.
        GatedCollectiveError: called inside a rank-gated function or block.

    Example:
        >>> for step in range(start, total_steps):
        ...     train_step(batch)
        ...     if accel.stop_requested():
        ...         accel.save_state(root, model=model, optimizer=opt, step=step + 1)
        ...         break
    """
    gate = current_gate()
    if gate is not None:
        raise GatedCollectiveError(
            "accel.stop_requested() must be called on every rank (it agrees across ranks) but "
            f"was called inside {gate}, which runs on only some ranks. Call "
            "`accel.stop_requested()` outside the gated function or block and pass the result in."
        )
    if not has_active_state():
        raise NotDistributedError(
            "accel.stop_requested() was called outside a `with accel.distributed():` block; it "
            "installs signal handlers for the block and restores them at its end. Call it "
            "inside the block, e.g. `with accel.distributed(): ... if accel.stop_requested(): "
            "break`."
        )
    watch = _WATCH.get()
    if watch is None:
        world_size = state().world_size
        if world_size > 1 and not dist.is_initialized():
            raise NotDistributedError(
                f"accel.stop_requested() agrees across the {world_size} processes of this job, "
                "but no process group is initialised. Call it inside the outermost "
                "`with accel.distributed():` block (it joins the launcher's group)."
            )
        watch = _Watch(world_size)
        _WATCH.set(watch)
        at_block_exit(_finish)
    return watch.poll()


def _finish(failed: bool) -> None:
    """The block's exit step: settle the watch (see :func:`stop_requested`).

    On a clean exit the all-reduce still in flight is waited for (before the process group is
    destroyed); when an exception leaves the block nothing is waited for. Either way the signal
    handlers that were there before are restored.
    """
    watch = _WATCH.pop()
    if watch is not None:
        watch.finish(failed=failed)

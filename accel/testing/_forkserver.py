"""The warm fork server that the processes of ``accel.testing``'s runs fork from.

:func:`context` is the multiprocessing context of ``run_distributed``, ``run_script`` and
``start_script``: a fork server that has torch and accel imported (~0.1 s a process instead of
~2 s for a fresh interpreter), or ``spawn`` where there is no fork server. The server imports
:data:`PRELOAD` and what :func:`add_preload` added (``accel.testing.preload``), with
``accel.testing._warm_server`` last: it freezes what the others imported and, on Linux, has
the server end what its processes leave behind (:func:`end_what_workers_leave`).

Example:
    >>> ctx = context()
    >>> proc = ctx.Process(target=print, args=("hello",))
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any

from accel.errors import ConfigError

# What the server imports once, before it forks workers: torch, torch._dynamo (which torch
# imports on first use of an optimizer or of torch.compile: seconds in every fresh process),
# FSDP and distributed checkpoints, accel and run_script's entry point; accel.testing._warm_server,
# last, imports accel's public modules and freezes all of it.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "accel.testing", "accel.launch.worker",
           "accel.testing._warm_server")
_EXTRA: list[str] = []  # accel.testing.preload()'s modules
_STARTED = [False]  # whether a run has asked for the server in this process


def add_preload(modules: Iterable[str]) -> None:
    """Have the server also import ``modules`` (checked importable by the caller).

    Raises:
        ConfigError: the server is in use already, so it would not import them.
    """
    modules = tuple(modules)
    if _STARTED[0]:
        raise ConfigError(
            f"preload{modules!r} comes after the warm server started in this process, so it "
            "would not import them. Call preload() before the first run_distributed / "
            "run_script (e.g. at the top of conftest.py)."
        )
    _EXTRA.extend(m for m in modules if m not in _EXTRA)


def context() -> Any:
    """The fork server context (``spawn`` where the platform has no fork server)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD[:-1], *_EXTRA, PRELOAD[-1]])
        _STARTED[0] = True
        return ctx
    return mp.get_context("spawn")


# ----- in the server: ending what the processes it forked leave behind (Linux) -----

_PR_SET_CHILD_SUBREAPER = 36
_FORKED: set[int] = set()  # the server's own children: the processes it forked, still unreaped


def end_what_workers_leave() -> bool:
    """In the fork server: kill what each process it forked leaves behind, when that ends.

    A process that ends leaves its children running, re-parented to PID 1: the ``sleep`` a
    script started with ``subprocess.Popen``, a daemon, a child in a new session
    (``start_new_session=True``, out of reach of a kill of the rank's process group), a
    Python ``os.fork`` child holding every descriptor of the rank (the server's "alive" pipe
    among them: while it runs, the server, whose stdout is the caller's, runs too). Here,
    every process the server forks is a child subreaper (Linux's ``PR_SET_CHILD_SUBREAPER``):
    while it runs, what its descendants orphan is re-parented to it, not to PID 1. The server
    is one too: when a forked process ends, whatever it had below it is re-parented to the
    server, which kills it, everything below it included, before it reports the exit to the
    caller. Its own processes, and what they have below them while they run, are never
    touched.

    The server's loop (``multiprocessing.forkserver.main``) forks and reaps through
    ``os.fork`` and ``os.waitpid``: both are wrapped in the server (each forked process gets
    the plain functions back at once). Returns whether it is in place (Linux, prctl accepted).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False

    def become_subreaper() -> bool:
        return int(prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0

    if not become_subreaper():  # a kernel before 3.4
        return False
    _FORKED.update(_children(os.getpid()))  # anything a preloaded module started is not an orphan
    plain_fork, plain_waitpid = os.fork, os.waitpid

    def fork() -> int:
        pid = plain_fork()
        if pid == 0:  # a worker: the plain functions; what it orphans stays below it
            _install(plain_fork, plain_waitpid)
            become_subreaper()
        else:
            _FORKED.add(pid)
        return pid

    def waitpid(pid: int, options: int, /) -> tuple[int, int]:
        while True:
            found, status = plain_waitpid(pid, options)
            if found == 0:
                return found, status
            forked = found in _FORKED
            _FORKED.discard(found)
            try:
                _end_orphans()
            except Exception:  # never the server's end: an orphan left is the old behaviour
                pass
            if forked or pid != -1:
                return found, status
            # an orphan killed here: reaped without a word (the loop would warn of it)

    _install(fork, waitpid)
    return True


def _install(fork: Callable[[], int], waitpid: Callable[[int, int], tuple[int, int]]) -> None:
    os.fork = fork
    os.waitpid = waitpid


def _end_orphans() -> None:
    """Kill the server's children that it did not fork, with everything below them.

    They are orphans of forked processes that have ended (a forked process keeps its own while
    it runs): what a rank left. The killed become the server's zombies, reaped by its loop.
    """
    orphans = [pid for pid in _children(os.getpid()) if pid not in _FORKED]
    doomed = set(orphans)
    for pid in orphans:
        doomed |= _descendants(pid)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # ended meanwhile; or not ours to kill (a set-user-ID program)
            pass


def _descendants(root: int) -> set[int]:
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _children(pid: int) -> list[int]:
    """The children of ``pid``: every thread's, from ``/proc`` (one small read a thread)."""
    if not _children_files():
        return _children_by_stat(pid)
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:  # ended
        return found
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as file:
                found.extend(int(child) for child in file.read().split())
        except OSError:  # the thread ended
            pass
    return found


@functools.cache
def _children_files() -> bool:
    """Whether the kernel lists a thread's children in ``/proc`` (``CONFIG_PROC_CHILDREN``)."""
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _children_by_stat(pid: int) -> list[int]:
    """The children of ``pid``, from every process's parent in ``/proc/PID/stat`` (slower)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as file:
                    if int(file.read().rpartition(")")[2].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):  # ended meanwhile
                pass
    return found

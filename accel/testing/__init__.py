"""Helpers for testing distributed code: real processes over gloo, and faked ranks.

Example:
    >>> def body(x):
    ...     return accel.gather(torch.tensor([accel.state().rank * x])).tolist()
    >>> run_distributed(body, 10, world_size=2)
    [[0, 10], [0, 10]]
"""

from __future__ import annotations

import datetime
import importlib.machinery
import importlib.util
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from accel.core.env import environ_snapshot
from accel.core.scope import Scope
from accel.core.settings import cpu_count
from accel.core.state import ProcessState, set_state
from accel.errors import CollectiveTimeoutError, ConfigError, RemoteError
from accel.testing._forkserver import add_preload, context
from accel.testing._script_result import ScriptResult
from accel.testing._script_run import RunningScript, run_script, start_script

__all__ = ["RunningScript", "ScriptResult", "fake_state", "preload", "run_distributed",
           "run_script", "start_script"]

R = TypeVar("R")

_POLL_S = 0.02
_GRACE_S = 3.0  # after one rank fails, how long the others get to finish or fail too


class _RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in a worker process."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    timeout: float,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    options: dict[str, Any],
    environ: dict[str, str],
    results: Any,
) -> None:
    # Workers fork from a long-lived server: give them the caller's environment as it is now,
    # as a freshly spawned process would have it.
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    from accel.core.process_group import distributed

    try:
        torch.set_num_threads(max(1, cpu_count() // world_size))
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        # every rank's connections are up before any may leave: a rank whose function makes
        # no collective would otherwise close its side while a peer is still in gloo's
        # connectFullMesh ("Connection closed by peer")
        dist.barrier()
        try:
            with distributed(**options):
                value = function(*args)
        except BaseException as exc:
            # report first: leaving the group releases a peer blocked in a collective with a
            # lost-connection error, which should arrive second (the parent also ranks it last)
            _report_failure(results, rank, exc)
            try:
                dist.destroy_process_group()  # no collective: this rank leaves at once
            except Exception:  # its failure is reported already
                pass
            return
        dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # report everything, including KeyboardInterrupt/SystemExit
        _report_failure(results, rank, exc)


def _report_failure(results: Any, rank: int, exc: BaseException) -> None:
    """Send a worker's exception to the parent: its traceback, and itself when it pickles."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    payload: bytes | None
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)
    except Exception:  # an exception that cannot travel is sent as text
        payload = None
    results.put((rank, False, (type(exc).__name__, str(exc), text, payload)))


def preload(*modules: str) -> None:
    """Have the warm server also import ``modules``, once, before it forks any process.

    The processes of :func:`run_distributed`, :func:`run_script` and :func:`start_script`
    fork from a server that has torch and accel imported. A library that the workers import
    themselves (``transformers``, a model package) costs its import time in every process;
    preloaded, it costs it once. Call it before the first run of the process, e.g. at the top
    of ``conftest.py``.

    Raises:
        ConfigError: a module that cannot be found, or the server is in use already.

    Example:
        >>> preload("transformers", "transformers.models.gpt2.modeling_gpt2")
    """
    for name in modules:
        if not isinstance(name, str) or not name or not _importable(name):
            raise ConfigError(
                f"preload({name!r}): no such module. Give importable module names, e.g. "
                "`preload('transformers')`."
            )
    add_preload(modules)


def _importable(name: str) -> bool:
    """Whether module ``name`` can be found on ``sys.path``, importing nothing.

    ``importlib.util.find_spec`` imports a dotted name's parent packages; here each part is
    looked up in its parent's directories instead, so checking ``transformers.models.gpt2``
    does not import transformers into the calling process.
    """
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return False
    path: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        full = ".".join(parts[:depth])
        module = sys.modules.get(full)
        if module is not None:  # imported already
            path = list(getattr(module, "__path__", []))
            continue
        spec = importlib.machinery.PathFinder.find_spec(full, path)
        if spec is None:
            return depth == 1 and importlib.util.find_spec(full) is not None  # a builtin
        path = list(spec.submodule_search_locations or [])
    return True


def _raise_failure(rank: int, world_size: int, failure: tuple[str, str, str, bytes | None]) -> None:
    name, message, text, payload = failure
    remote = _RemoteTraceback(f"\n\nTraceback from rank {rank} of {world_size}:\n{text}")
    loaded: object = pickle.loads(payload) if payload is not None else None
    exc = (
        loaded
        if isinstance(loaded, BaseException)
        else RemoteError(f"Rank {rank} of {world_size} raised {name}: {message}")
    )
    note = f"(raised on rank {rank} of {world_size}; its traceback is above)"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    raise exc from remote


def run_distributed(
    function: Callable[..., R],
    *args: Any,
    world_size: int = 2,
    timeout: float = 60.0,
    **distributed_options: Any,
) -> list[R]:
    """Run ``function(*args)`` on ``world_size`` CPU processes over gloo; return each result.

    Each process joins a gloo group (a FileStore in a temporary directory: no ports) and runs
    the function inside ``accel.distributed(**distributed_options)``. The function and its
    arguments must be picklable (defined at module level). The first exception raised on any
    rank is re-raised here as itself, with the rank and its remote traceback chained (a rank
    that only lost its connection to a failed peer is not taken for the cause); a run that
    exceeds ``timeout`` seconds is killed.

    Args:
        function: a module-level function to run on every rank.
        *args: its positional arguments (the same on every rank).
        world_size: number of processes.
        timeout: seconds before the whole run is killed.
        **distributed_options: passed to ``accel.distributed()`` in each process.

    Returns:
        The return values in rank order.

    Raises:
        CollectiveTimeoutError: the run exceeded ``timeout``; names the ranks still running.

    Example:
        >>> run_distributed(rank_times_two, world_size=3)
        [0, 2, 4]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world_size={world_size!r} must be an integer >= 1, e.g. `world_size=2`."
        )
    ctx = context()
    results = ctx.Queue()
    done: dict[int, bytes] = {}
    failures: list[tuple[int, tuple[str, str, str, bytes | None]]] = []
    with tempfile.TemporaryDirectory(prefix="accel-run-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, store_path, timeout, function, args,
                      distributed_options, environ_snapshot(), results),
                name=f"accel-rank-{rank}",
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        grace_end: float | None = None
        dead_since: dict[int, float] = {}
        try:
            while len(done) + len(failures) < world_size:
                now = time.monotonic()
                if now >= deadline or (grace_end is not None and now >= grace_end):
                    break
                try:
                    rank, ok, payload = results.get(timeout=_POLL_S)
                except queue.Empty:
                    _note_silent_deaths(procs, done, failures, dead_since)
                else:
                    if ok:
                        done[rank] = payload
                    else:
                        failures.append((rank, payload))
                if failures and grace_end is None:
                    grace_end = time.monotonic() + _GRACE_S
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(5)
            results.close()
    if failures:
        rank, failure = _root_cause(failures)
        _raise_failure(rank, world_size, failure)
    if len(done) < world_size:
        running = [r for r in range(world_size) if r not in done]
        raise CollectiveTimeoutError(
            f"run_distributed({getattr(function, '__name__', function)!r}) exceeded "
            f"timeout={timeout!r}s: ranks {running} never finished (finished: {sorted(done)}). "
            "Look for a collective called on only some ranks, or pass a larger `timeout=`."
        )
    return [pickle.loads(done[r]) for r in range(world_size)]


def _root_cause(
    failures: list[tuple[int, tuple[str, str, str, bytes | None]]],
) -> tuple[int, tuple[str, str, str, bytes | None]]:
    """The failure to re-raise: the first one that is not a rank losing its peer.

    When one rank fails, a peer blocked in a collective with it fails too, with a lost
    connection; that error can even arrive first, but it is a consequence, not the cause.
    """
    from accel.launch.run import is_peer_loss

    _, first = min(enumerate(failures), key=lambda pair: (is_peer_loss(pair[1][1][2]), pair[0]))
    return first


def _note_silent_deaths(
    procs: list[Any],
    done: dict[int, bytes],
    failures: list[tuple[int, tuple[str, str, str, bytes | None]]],
    dead_since: dict[int, float],
) -> None:
    """Record ranks whose process exited without reporting (killed, ``os._exit``...).

    A worker flushes its report before it exits, so a report is at most a moment behind the
    exit: a rank counts as silently dead once it has been gone for a second with no report.
    """
    reported = set(done) | {rank for rank, _ in failures}
    now = time.monotonic()
    for rank, proc in enumerate(procs):
        if rank in reported or proc.exitcode is None:
            continue
        if now - dead_since.setdefault(rank, now) < 1.0:
            continue
        code = proc.exitcode
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        message = f"process exited with {how} without returning a result or raising"
        failures.append((rank, ("ProcessExit", message, message + "\n", None)))


@contextmanager
def fake_state(**fields: Any) -> Iterator[ProcessState]:
    """Pretend, in this process, to be the rank described by ``fields`` (no processes).

    Gating, sharding maths and policies read the faked state; collectives are not faked.

    Example:
        >>> with fake_state(rank=1, world_size=4) as st:
        ...     st.is_main_process
        False
    """
    with set_state(ProcessState(**fields), Scope()) as st:
        yield st

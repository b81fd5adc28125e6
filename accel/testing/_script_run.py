"""``accel.testing.run_script``: a script's ``__main__`` on N processes, as ``accel launch`` would.

The processes fork from the warm server that :func:`accel.testing.run_distributed` uses (torch
and accel imported once), so a run starts in a fraction of a second instead of an interpreter
start and a ``torch`` import per process plus torch's elastic agent.

What each process gets is what ``accel launch --nproc-per-node N --cpu script.py args`` gives
its workers: the caller's environment, then the variables the launch plan sets (``ACCEL_*``
from the environment and the config file, ``ACCEL_CPU``, ``OMP_NUM_THREADS``), then torch's
worker variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a
store hosted by this process as torch's agent hosts it, ``TORCHELASTIC_*``...). The script runs
through :mod:`accel.launch.worker`, the entry point of launched workers (``__main__``,
``sys.argv``, ``sys.path[0]``, failure records), in the given working directory.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback
import uuid
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from accel.core.env import environ_snapshot, read_launch_env, read_variable
from accel.core.settings import cpu_count
from accel.errors import CollectiveTimeoutError, ConfigError, LaunchError
from accel.launch.failures import exit_text
from accel.testing._script_result import ScriptResult, tail

__all__ = ["RunningScript", "run_script", "start_script"]

_GRACE_S = 3.0  # after one rank fails, how long the others get to end (as run_distributed)
_POLL_S = 0.005  # wait_for's polling interval
_HOST = "localhost"  # torch's agent gives its workers this MASTER_ADDR on one machine
_STACK_SIGNAL = signal.SIGUSR2  # dumps a rank's Python stacks (faulthandler) before a kill
_STACK_WAIT_S = 0.5  # how long the ranks get to write their stacks


def _script_worker(script: str, args: tuple[str, ...], cwd: str, environ: dict[str, str],
                   out_path: str, err_path: str, launch: bool) -> None:
    """One rank: the launcher's environment and output files, then the script as ``__main__``.

    Runs in a process forked from the warm server; its exit status is the script's (the
    ``SystemExit`` raised by :func:`accel.launch.worker.main` ends the process with it).
    """
    os.setpgid(0, 0)  # its own process group: a kill reaches the script's children too
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # line-buffered, so that a rank killed at the timeout leaves its last lines behind
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        # the process's stdio until it ends: no context manager
        stream = open(fd, "w", buffering=1, encoding="utf-8", errors=errors,  # noqa: SIM115
                      closefd=False)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # at the timeout, SIGUSR2 first: the rank writes its threads' stacks to its stderr
    faulthandler.register(_STACK_SIGNAL, all_threads=True, chain=False)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import torch

    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read at start-up by a fresh interpreter
        torch.set_num_threads(int(threads))
    # The finalizers of objects the server made while importing (torch's operator libraries:
    # ~0.2 s of deregistering in a process about to end) are left out of the exit; the
    # script's own exit functions and finalizers run as at any interpreter's exit.
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False
    try:
        if launch:
            from accel.launch.worker import main

            main([script, *args])
        else:
            _run_as_python(script, args)
    finally:
        atexit._run_exitfuncs()


def _run_as_python(script: str, args: tuple[str, ...]) -> None:
    """``python script.py args``: ``sys.argv`` as typed, its traceback, its exit status.

    An uncaught exception prints its traceback and exits 1; an uncaught KeyboardInterrupt
    ends the process by SIGINT, as CPython does.
    """
    from accel.launch.worker import user_frames

    filename = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(filename)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:
        error.__traceback__ = user_frames(error.__traceback__, filename)
        traceback.print_exception(type(error), error, error.__traceback__)
        sys.stderr.flush()
        if isinstance(error, KeyboardInterrupt):
            sys.stdout.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


def _launch_variables(script: str, args: Sequence[str], world_size: int,
                      environ: Mapping[str, str]) -> dict[str, str]:
    """The variables ``accel launch --nproc-per-node N --cpu`` adds for its workers."""
    from accel.cli.main import build_parser
    from accel.core.config_file import config_path, load_config
    from accel.launch.run import plan_launch

    ns = build_parser().parse_args(
        ["launch", "--nproc-per-node", str(world_size), "--cpu", script, *args])
    launch_env = read_launch_env(environ)
    path, how = config_path(None, env=launch_env, environ=environ)
    exists = path.is_file()
    file_settings = load_config(path) if exists or how != "user config dir" else {}
    plan = plan_launch(ns, env=launch_env, file_settings=file_settings,
                       config_file=path if exists else None, gpu_count=lambda: 0,
                       cpu_count=cpu_count(),
                       omp_num_threads_set=read_variable("OMP_NUM_THREADS", environ) is not None)
    found = dict(plan.worker_env)
    torchrun = list(plan.torchrun_args)
    if "--signals-to-handle" in torchrun:  # torch's launcher exports them to its workers
        signals = torchrun[torchrun.index("--signals-to-handle") + 1]
        found["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals
    return found


def _rank_variables(rank: int, world_size: int, port: int, run_id: str, error_file: str,
                    environ: Mapping[str, str]) -> dict[str, str]:
    """What torch's elastic agent sets for a worker on one machine (the agent hosts the store)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": _HOST, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _check_arguments(world_size: object, timeout: object, launch: bool) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world_size={world_size!r} must be an integer >= 1, e.g. `world_size=2`."
        )
    if not launch and world_size != 1:
        raise ConfigError(
            f"launch=False runs the script as `python script.py` (one process), but "
            f"world_size={world_size!r}. Pass `world_size=1`, or drop `launch=False`."
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(
            f"timeout={timeout!r} must be a number of seconds > 0, e.g. `timeout=120`."
        )


class RunningScript:
    """A script started by :func:`start_script`, running on its ranks.

    Use it as a context manager (leaving the block kills what still runs and removes the
    captured output), or call :meth:`wait`, which returns the :class:`ScriptResult`.

    Example:
        >>> with start_script("train.py", "--total-steps", "100") as run:
        ...     run.wait_for("step 5")
        ...     run.send_signal(signal.SIGTERM)
        ...     result = run.wait()
    """

    def __init__(self, script: str, args: tuple[str, ...], *, world_size: int,
                 environ: dict[str, str], cwd: str, timeout: float, launch: bool) -> None:
        import torch.distributed as dist

        from accel.testing._forkserver import context

        self.script, self.args, self.timeout = script, args, timeout
        self._deadline = time.monotonic() + timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="accel-script-")
        self._files = [tuple(os.path.join(self._tmp.name, f"{rank}.{kind}")
                             for kind in ("out", "err", "error.json"))
                       for rank in range(world_size)]
        self._store: Any = None
        environs = [environ]
        if launch:
            # torch's agent hosts the rendezvous store and its workers join it as clients
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                _HOST, 0, is_master=True, wait_for_workers=False)
            run_id = uuid.uuid4().hex
            environs = [{**environ, **_rank_variables(rank, world_size, self._store.port, run_id,
                                                      self._files[rank][2], environ)}
                        for rank in range(world_size)]
        ctx = context()
        self._procs = [
            ctx.Process(target=_script_worker,
                        args=(script, args, cwd, environs[rank], *self._files[rank][:2],
                              launch),
                        name=f"accel-script-rank-{rank}")
            for rank in range(world_size)
        ]
        self._ended: dict[int, float] = {}
        self._result: ScriptResult | None = None
        try:
            for proc in self._procs:
                proc.start()
        except BaseException:
            self.close()
            raise

    def stdout(self, rank: int = 0) -> str:
        """What ``rank`` has written to its standard output so far."""
        return _read(self._files[rank][0])

    def stderr(self, rank: int = 0) -> str:
        """What ``rank`` has written to its standard error so far."""
        return _read(self._files[rank][1])

    def wait_for(self, text: str, *, rank: int = 0, count: int = 1,
                 timeout: float | None = None) -> None:
        """Return once ``rank``'s stdout holds ``text`` ``count`` times.

        Raises:
            LaunchError: the rank ended first; quotes its output.
            CollectiveTimeoutError: not seen within ``timeout`` seconds (default: what is
                left of the run's timeout).
        """
        limit = self._deadline if timeout is None else time.monotonic() + timeout
        while self.stdout(rank).count(text) < count:
            proc = self._procs[rank]
            if proc.exitcode is not None and self.stdout(rank).count(text) < count:
                raise LaunchError(
                    f"run_script: rank {rank} of {Path(self.script).name} ended "
                    f"({exit_text(proc.exitcode)}) before printing {text!r} x{count}.\n"
                    f"----- its stdout -----\n{tail(self.stdout(rank))}\n"
                    f"----- its stderr -----\n{tail(self.stderr(rank))}"
                )
            if time.monotonic() >= limit:
                raise CollectiveTimeoutError(
                    f"run_script: rank {rank} of {Path(self.script).name} did not print "
                    f"{text!r} x{count} in time; its stdout so far:\n{tail(self.stdout(rank))}"
                )
            proc.join(_POLL_S)

    def send_signal(self, signum: int, rank: int | None = None) -> None:
        """Send ``signum`` to one rank's process, or to every rank's still running."""
        ranks = range(len(self._procs)) if rank is None else [rank]
        for r in ranks:
            proc = self._procs[r]
            if proc.pid is not None and proc.exitcode is None:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:  # ended in the meantime
                    pass

    def wait(self, *, check: bool = True) -> ScriptResult:
        """Wait for every rank (the run's timeout applies); return or raise as ``run_script``.

        After a rank fails, the others get a few seconds to end, then are killed.
        """
        if self._result is None:
            stopped, timed_out = self._wait()
            self._dump_stacks(stopped)
            self.close()
            codes = tuple(int(p.exitcode if p.exitcode is not None else -signal.SIGKILL)
                          for p in self._procs)
            outputs = [(_read(out), _read(err), _error_record(record))
                       for out, err, record in self._files]
            records = [record for _, _, record in outputs]
            failed, trace = _root_cause(codes, records, self._ended, stopped)
            if failed is not None and trace is None and codes[failed] == 1:
                trace = _traceback_in(outputs[failed][1])  # `python script.py`: no record
            self._result = ScriptResult(
                script=self.script, args=self.args, exit_codes=codes,
                stdout=tuple(out for out, _, _ in outputs),
                stderr=tuple(err for _, err, _ in outputs), timeout=self.timeout,
                timed_out=timed_out, killed=tuple(sorted(stopped)), failed_rank=failed,
                traceback=trace,
            )
            self._tmp.cleanup()
        return self._result.check() if check else self._result

    def _wait(self) -> tuple[set[int], bool]:
        """Wait for the ranks; which were still running at the end, and whether time ran out."""
        procs = self._procs
        grace_end: float | None = None
        while len(self._ended) < len(procs):
            now = time.monotonic()
            limit = self._deadline if grace_end is None else min(self._deadline, grace_end)
            if now >= limit:
                break
            wait([p.sentinel for r, p in enumerate(procs) if r not in self._ended],
                 timeout=limit - now)
            for rank, proc in enumerate(procs):
                if rank not in self._ended and proc.exitcode is not None:
                    self._ended[rank] = time.time()  # the clock of the error records
                    if proc.exitcode != 0 and grace_end is None:
                        grace_end = time.monotonic() + _GRACE_S
        stopped = {rank for rank in range(len(procs)) if rank not in self._ended}
        return stopped, bool(stopped) and grace_end is None

    def _dump_stacks(self, ranks: set[int]) -> None:
        """Have the ranks about to be killed write their Python stacks to their stderr."""
        for rank in ranks:
            self.send_signal(_STACK_SIGNAL, rank)
        if ranks:
            time.sleep(_STACK_WAIT_S)

    def close(self) -> None:
        """Kill every rank still running, with the processes it started; reap them all."""
        for proc in self._procs:
            if proc.pid is not None and proc.exitcode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # not its group leader yet
                    proc.kill()
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(10)
        self._store = None  # the rendezvous store's server stops

    def __enter__(self) -> RunningScript:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._tmp.cleanup()


def start_script(
    script: str | os.PathLike[str],
    *args: str | os.PathLike[str],
    world_size: int = 2,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    launch: bool = True,
) -> RunningScript:
    """Start what :func:`run_script` runs and return at once, with a handle on the ranks.

    For tests that act on a running script: wait for a line, send a signal, kill it. The
    arguments are :func:`run_script`'s.

    Example:
        >>> with start_script("train.py", world_size=2) as run:
        ...     run.wait_for("step 10")
        ...     run.send_signal(signal.SIGTERM)
        ...     assert run.wait().exit_codes == (0, 0)
    """
    _check_arguments(world_size, timeout, launch)
    name = os.fspath(script)
    arguments = tuple(os.fspath(a) for a in args)
    workdir = os.path.abspath(os.getcwd() if cwd is None else os.fspath(cwd))
    if not os.path.isfile(os.path.join(workdir, name)):
        raise ConfigError(
            f"run_script: script {name!r} not found (looked in cwd={workdir!r}). Give a "
            "path to an existing file, absolute or relative to `cwd=`."
        )
    environ = environ_snapshot()
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    if launch:
        environ.update(_launch_variables(name, arguments, world_size, environ))
    return RunningScript(name, arguments, world_size=world_size, environ=environ, cwd=workdir,
                         timeout=float(timeout), launch=launch)


def run_script(
    script: str | os.PathLike[str],
    *args: str | os.PathLike[str],
    world_size: int = 2,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    check: bool = True,
    launch: bool = True,
) -> ScriptResult:
    """Run ``script args`` as ``accel launch --nproc-per-node N --cpu`` would, on warm workers.

    Each of the ``world_size`` processes forks from a server that has torch and accel
    imported, gets the variables ``accel launch`` gives its workers (so
    ``accel.distributed()`` joins a fresh gloo group over a store this process hosts, as
    torch's agent does) and runs the script as ``__main__`` in ``cwd``. Output is captured
    per rank. The first failing rank (a rank that only lost its connection to a failed peer
    is not taken for the cause) ends the run: the others get a few seconds, then are
    killed. Past ``timeout`` every rank still running is killed. No restarts.

    Args:
        script: the script, relative to ``cwd`` or absolute.
        *args: its command-line arguments (``sys.argv[1:]``).
        world_size: number of processes (all on this machine, CPU and gloo).
        env: variables added to this process's environment for the run (``None`` as a value
            removes one), as if exported before ``accel launch``.
        cwd: the working directory of every rank (default: this process's).
        timeout: seconds before the ranks still running are killed.
        check: raise when a rank fails or the run times out (else see the result).
        launch: ``False`` runs the script as ``python script.py args`` would instead: one
            process, no launcher variables (``world_size=1``).

    Returns:
        A :class:`ScriptResult`: each rank's exit code, stdout and stderr.

    Raises:
        LaunchError: (with ``check``) a rank exited non-zero; names it, its exit code, and
            quotes its traceback.
        CollectiveTimeoutError: (with ``check``) the run exceeded ``timeout``; names the
            ranks that were still running and quotes their last output.
        ConfigError: a bad argument, a missing script, or a launch option (environment,
            config file) that ``accel launch`` would refuse too.

    Example:
        >>> result = run_script("train.py", "--epochs", "1", world_size=2, cwd=tmp_path)
        >>> result.exit_codes, "finished" in result.output
        ((0, 0), True)
    """
    with start_script(script, *args, world_size=world_size, env=env, cwd=cwd,
                      timeout=timeout, launch=launch) as run:
        return run.wait(check=check)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except FileNotFoundError:  # killed before it opened its files
        return ""


def _traceback_in(stderr: str) -> str | None:
    """The last traceback printed on ``stderr`` (a script run without the launcher)."""
    start = stderr.rfind("Traceback (most recent call last):")
    return stderr[start:] if start != -1 else None


def _error_record(path: str) -> tuple[str, float] | None:
    """The traceback and time that :mod:`accel.launch.worker` recorded for a failed rank."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        extra = data["message"]["extraInfo"]
        return str(extra["py_callstack"]), float(extra["accel_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _root_cause(codes: tuple[int, ...], records: list[tuple[str, float] | None],
                ended: dict[int, float], stopped: set[int]) -> tuple[int | None, str | None]:
    """The first failing rank and its traceback: a real error before a lost peer.

    Ranks killed here (after another rank failed, or at the timeout) come last.
    """
    from accel.launch.failures import is_peer_loss

    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if not failed:
        return None, None

    def order(rank: int) -> tuple[bool, bool, float]:
        record = records[rank]
        trace = record[0] if record else ""
        when = record[1] if record else ended.get(rank, float("inf"))
        return is_peer_loss(trace), rank in stopped, when

    first = min(failed, key=order)
    record = records[first]
    return first, (record[0] if record else None)

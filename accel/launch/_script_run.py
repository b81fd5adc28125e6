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
import json
import os
import signal
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import attrs

from accel._env import environ_snapshot, read_launch_env, read_variable
from accel._settings import cpu_count
from accel.errors import CollectiveTimeoutError, ConfigError, LaunchError

__all__ = ["ScriptResult", "run_script"]

_GRACE_S = 3.0  # after one rank fails, how long the others get to end (as run_distributed)
_TAIL_LINES = 25  # lines of a rank's output quoted in an error
_HOST = "localhost"  # torch's agent gives its workers this MASTER_ADDR on one machine


@attrs.frozen(kw_only=True)
class ScriptResult:
    """What each rank of a :func:`run_script` run did (tuples are indexed by rank).

    Attributes:
        script: the script as given.
        args: its arguments.
        exit_codes: each rank's exit status: the script's ``sys.exit`` code (1 after an
            uncaught exception), or minus the signal that killed it (``-9``: killed at the
            timeout, or after another rank failed).
        stdout: each rank's standard output.
        stderr: each rank's standard error.
        timeout: the run's timeout, in seconds.
        timed_out: the run reached its timeout and the ranks still running were killed.
        failed_rank: the first failing rank (a rank that only lost its connection to a failed
            peer is not taken for the cause), or ``None``.
        traceback: that rank's Python traceback, trimmed to the script's frames as
            ``accel launch`` reports it; ``None`` when it exited without an exception.
    """

    script: str
    args: tuple[str, ...]
    exit_codes: tuple[int, ...]
    stdout: tuple[str, ...]
    stderr: tuple[str, ...]
    timeout: float
    timed_out: bool = False
    failed_rank: int | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        """Every rank exited 0 within the timeout."""
        return not self.timed_out and all(code == 0 for code in self.exit_codes)

    @property
    def output(self) -> str:
        """Every rank's standard output, one after the other in rank order."""
        return "".join(self.stdout)

    def check(self) -> ScriptResult:
        """Return this result if every rank exited 0; else raise what went wrong.

        Raises:
            CollectiveTimeoutError: the run timed out; names the ranks still running and
                quotes the end of their output.
            LaunchError: a rank failed; names the first failing rank, its exit code, and
                quotes its traceback (or the end of its standard error).

        Example:
            >>> run_script("train.py", check=False).check().exit_codes
            (0, 0)
        """
        if self.timed_out:
            raise CollectiveTimeoutError(self._describe_timeout())
        if self.failed_rank is not None:
            raise LaunchError(self._describe_failure(self.failed_rank))
        return self

    def _describe_failure(self, rank: int) -> str:
        code = self.exit_codes[rank]
        how = _exit_text(code)
        if self.traceback:
            last = self.traceback.rstrip().rsplit("\n", 1)[-1]
            how = f"raised {last}" + (f" ({how})" if code != 1 else "")
        lines = [f"run_script: {Path(self.script).name} failed on rank {rank} of "
                 f"{len(self.exit_codes)}: {how}.",
                 "exit codes by rank: " + ", ".join(str(c) for c in self.exit_codes)]
        if self.traceback:
            lines += [f"----- traceback of rank {rank} -----", self.traceback.rstrip("\n")]
        else:
            lines += [f"----- end of rank {rank}'s stderr -----", _tail(self.stderr[rank])]
        lines.append("-" * 40)
        return "\n".join(lines)

    def _describe_timeout(self) -> str:
        hung = [rank for rank, code in enumerate(self.exit_codes) if code == -signal.SIGKILL]
        lines = [f"run_script({self.script!r}) exceeded timeout={self.timeout!r}s: ranks "
                 f"{hung} were still running and were killed (exit codes by rank: "
                 + ", ".join(str(c) for c in self.exit_codes) + "). Look for a collective "
                 "called on only some ranks, or pass a larger `timeout=`."]
        for rank in hung:
            lines += [f"----- end of rank {rank}'s stdout -----", _tail(self.stdout[rank]),
                      f"----- end of rank {rank}'s stderr -----", _tail(self.stderr[rank])]
        return "\n".join(lines)


def _exit_text(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _tail(text: str) -> str:
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-_TAIL_LINES:]) if lines else "(nothing)"


def _script_worker(script: str, args: tuple[str, ...], cwd: str, environ: dict[str, str],
                   out_path: str, err_path: str) -> None:
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
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import torch

    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read at start-up by a fresh interpreter
        torch.set_num_threads(int(threads))
    from accel.launch.worker import main

    # The finalizers of objects the server made while importing (torch's operator libraries:
    # ~0.2 s of deregistering in a process about to end) are left out of the exit; the
    # script's own exit functions and finalizers run as at any interpreter's exit.
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        finalizer.atexit = False
    try:
        main([script, *args])
    finally:
        atexit._run_exitfuncs()


def _launch_variables(script: str, args: Sequence[str], world_size: int,
                      environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The variables ``accel launch --nproc-per-node N --cpu`` would add, and its signals."""
    from accel._config_file import config_path, load_config
    from accel.launch.cli import build_parser
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
    torchrun = list(plan.torchrun_args)
    signals = ""
    if "--signals-to-handle" in torchrun:
        signals = torchrun[torchrun.index("--signals-to-handle") + 1]
    return dict(plan.worker_env), signals


def _rank_variables(rank: int, world_size: int, port: int, run_id: str, error_file: str,
                    signals: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What torch's elastic agent sets for a worker on one machine (the agent hosts the store)."""
    found = {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": _HOST, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if signals:
        found["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals
    return found


def _check_arguments(world_size: object, timeout: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"world_size={world_size!r} must be an integer >= 1, e.g. `world_size=2`."
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(
            f"timeout={timeout!r} must be a number of seconds > 0, e.g. `timeout=120`."
        )


def run_script(
    script: str | os.PathLike[str],
    *args: str | os.PathLike[str],
    world_size: int = 2,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
    check: bool = True,
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
    _check_arguments(world_size, timeout)
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
    plan_variables, signals = _launch_variables(name, arguments, world_size, environ)
    environ.update(plan_variables)
    import torch.distributed as dist

    from accel.testing import _context

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="accel-script-") as tmp:
        # torch's agent hosts the rendezvous store and its workers join it as clients
        store = dist.TCPStore(  # type: ignore[attr-defined]
            _HOST, 0, is_master=True, wait_for_workers=False)
        run_id = uuid.uuid4().hex
        files = [(os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err"),
                  os.path.join(tmp, f"{rank}.error.json")) for rank in range(world_size)]
        procs = [
            ctx.Process(
                target=_script_worker,
                args=(name, arguments, workdir,
                      {**environ, **_rank_variables(rank, world_size, store.port, run_id,
                                                    files[rank][2], signals, environ)},
                      files[rank][0], files[rank][1]),
                name=f"accel-script-rank-{rank}",
            )
            for rank in range(world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            ended, stopped, timed_out = _wait(procs, timeout)
        finally:
            _kill(procs)
            del store
        codes = tuple(int(proc.exitcode if proc.exitcode is not None else -signal.SIGKILL)
                      for proc in procs)
        outputs = [(_read(out), _read(err), _error_record(record))
                   for out, err, record in files]
    failed, trace = _root_cause(codes, [record for _, _, record in outputs], ended, stopped)
    result = ScriptResult(
        script=name, args=arguments, exit_codes=codes,
        stdout=tuple(out for out, _, _ in outputs), stderr=tuple(err for _, err, _ in outputs),
        timeout=timeout, timed_out=timed_out, failed_rank=failed, traceback=trace,
    )
    return result.check() if check else result


def _wait(procs: list[Any], timeout: float) -> tuple[dict[int, float], set[int], bool]:
    """Wait for the ranks; when each ended, which were stopped, and whether time ran out."""
    deadline = time.monotonic() + timeout
    grace_end: float | None = None
    ended: dict[int, float] = {}
    while len(ended) < len(procs):
        now = time.monotonic()
        limit = deadline if grace_end is None else min(deadline, grace_end)
        if now >= limit:
            break
        running = [proc.sentinel for rank, proc in enumerate(procs) if rank not in ended]
        wait(running, timeout=limit - now)
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.exitcode is not None:
                ended[rank] = time.time()  # the clock of the error records
                if proc.exitcode != 0 and grace_end is None:
                    grace_end = time.monotonic() + _GRACE_S
    stopped = {rank for rank in range(len(procs)) if rank not in ended}
    return ended, stopped, bool(stopped) and grace_end is None


def _kill(procs: list[Any]) -> None:
    """Kill every rank still running, with the processes it started; reap them all."""
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not its group leader yet
                proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join(10)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except FileNotFoundError:  # killed before it opened its files
        return ""


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

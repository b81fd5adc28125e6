"""``notebook_launcher`` and ``debug_launcher``: run a function on N processes from a notebook.

Both go through torch's elastic launcher (``elastic_launch``) with the *fork* start method, so
the function may be defined in the notebook itself (no pickling). The function runs with the
launch variables set (``RANK``, ``WORLD_SIZE``, ...), so ``with accel.distributed():`` inside
it joins the job exactly as in a script started by ``accel launch``.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from accel.core.env import environ_snapshot, read_launch_env, read_variable
from accel.core.settings import (
    DEFAULT_CPU_PROCESSES,
    DEFAULT_PORT,
    MIXED_PRECISION_MODES,
    cpu_count,
    did_you_mean,
    env_variable,
)
from accel.errors import ConfigError, LaunchError
from accel.launch.failures import describe_failure, is_peer_loss
from accel.launch.parent_death import die_with_parent

__all__ = ["debug_launcher", "notebook_launcher"]

# How long a worker whose error is a lost peer waits before it ends (see _run_in_worker).
_PEER_LOSS_LINGER_S = 2.0


def _attempt() -> int:
    """Which attempt of the job this worker belongs to (0, then 1 after a restart, ...)."""
    # the elastic agent numbers the attempts for its workers in this variable
    try:
        return int(read_variable("TORCHELASTIC_RESTART_COUNT") or "0")
    except ValueError:
        return 0


def _run_in_worker(
    function: Callable[..., Any], args: tuple[Any, ...], env: Mapping[str, str], reports: str
) -> Any:
    """Runs in each forked worker: set accel's options in its environment, call the function.

    The worker first marks its attempt as started in ``reports``. A failure is also written
    there with a precise time, the attempt and this process's id, so the launcher can name the
    rank that failed first in the last attempt (torch reports whichever failed process it
    notices first). A worker the launcher stopped (torch's termination handler raises
    ``SignalException`` in it) is marked as such: it is never the root cause.

    A worker that only lost its peer stays alive for up to :data:`_PEER_LOSS_LINGER_S` after
    its report: with forked workers torch records just the one failed process it sees first,
    and a peer that died without a report (``os._exit``, a SIGKILL) is the one to record.
    The launcher stops the lingering worker as soon as it sees that failure.
    """
    die_with_parent()  # a notebook (or script) killed outright takes its workers with it
    os.environ.update(env)  # the worker's own environment, read by accel.distributed()
    attempt = _attempt()
    rank = read_variable("RANK") or "0"
    try:
        open(os.path.join(reports, f"started-{attempt}"), "a").close()
    except OSError:
        pass  # best effort, like the report
    try:
        return function(*args)
    except BaseException as error:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        tb = error.__traceback__
        tb = tb.tb_next if tb is not None else None  # drop this wrapper's frame
        text = "".join(traceback.format_exception(type(error), error, tb))
        report = {"time": time.time(), "rank": int(rank), "attempt": attempt,
                  "pid": os.getpid(), "stopped": isinstance(error, SignalException),
                  "traceback": text}
        name = f"report-{attempt}-{rank}.json"
        try:
            with open(os.path.join(reports, name), "w", encoding="utf-8") as f:
                json.dump(report, f)
        except OSError:
            pass  # best effort: torch's own failure record still exists
        if not report["stopped"] and is_peer_loss(text):
            _linger()
        raise


def _linger() -> None:
    """Wait :data:`_PEER_LOSS_LINGER_S`, ending at once if the launcher stops this worker.

    The launcher stops workers with SIGTERM, which a training function may have taken over
    (``accel.preemption``'s handler only records it): the default action is put back first.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(_PEER_LOSS_LINGER_S)


def _first_report(reports: str, noticed: set[int]) -> dict[str, Any] | None:
    """The report of the root-cause failure of the last attempt, if a worker wrote one.

    Reports of earlier, restarted attempts are stale and workers the launcher stopped are
    never the cause. A report of a lost peer counts only when no process that torch saw fail
    (``noticed``, by pid) died without a report (such a silent death, e.g. a SIGKILL, is the
    likelier cause): otherwise ``None``, and torch's own record is described instead.
    """
    names = os.listdir(reports)
    started = [int(n.split("-", 1)[1]) for n in names if n.startswith("started-")]
    found: list[dict[str, Any]] = []
    for name in names:
        if not name.startswith("report-"):
            continue
        try:
            with open(os.path.join(reports, name), encoding="utf-8") as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue
    last = max(started + [int(r["attempt"]) for r in found], default=0)
    current = [r for r in found if int(r["attempt"]) == last]
    causes = [r for r in current if not r["stopped"]]
    if not causes:
        return None
    first: dict[str, Any] = min(
        causes, key=lambda r: (is_peer_loss(str(r["traceback"])), float(r["time"]))
    )
    silent = noticed - {r["pid"] for r in current}
    if is_peer_loss(str(first["traceback"])) and silent:
        return None
    return first


def _refuse_unsafe_parent(name: str, *, cuda_matters: bool = True) -> None:
    launch_env = read_launch_env()
    if launch_env.launcher != "none" and launch_env.world_size > 1:
        raise LaunchError(
            f"{name}() was called inside a process that a launcher already started "
            f"({launch_env.launcher}, rank {launch_env.rank} of {launch_env.world_size}): it "
            "would start processes from every rank. Call the training function directly "
            f"instead of `{name}(...)`, or run the notebook without `accel launch`/torchrun."
        )
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise LaunchError(
            f"{name}() was called while this process is already in a torch.distributed "
            "process group. Call it from a fresh notebook/REPL process, outside "
            "`accel.distributed()`."
        )
    if cuda_matters and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise LaunchError(
            f"CUDA is already initialised in this process, so {name}() cannot fork worker "
            "processes (a forked child cannot use CUDA). Something in the notebook touched the "
            "GPU before the launch (e.g. `model.cuda()`, `torch.cuda.device_count()` on some "
            "setups, `torch.zeros(1, device='cuda')`). Restart the kernel and keep every CUDA "
            f"call inside the function you pass to `{name}(...)`."
        )


def _count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{name}={value!r} must be an integer >= {minimum}, e.g. `{name}={max(minimum, 2)}`."
        )
    return value


def _cpu_threads(nproc: int) -> dict[str, str]:
    # the launcher decides the worker's thread count unless the user chose one
    if read_variable("OMP_NUM_THREADS") is not None:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cpu_count() // nproc))}


def _launch(
    function: Callable[..., Any],
    args: Sequence[Any],
    *,
    nproc: int,
    num_nodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    max_restarts: int,
    env: dict[str, str],
    name: str,
) -> list[Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if num_nodes == 1 and master_port is None:
        # c10d rendezvous on port 0: the OS picks a free port, so launches never collide
        rdzv: dict[str, Any] = {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0",
                                "run_id": str(uuid.uuid4())}
    else:
        rdzv = {"rdzv_backend": "static",
                "rdzv_endpoint": f"{master_addr}:{master_port or DEFAULT_PORT}",
                "rdzv_configs": {"rank": node_rank}, "run_id": "accel-notebook"}
    config = LaunchConfig(min_nodes=num_nodes, max_nodes=num_nodes, nproc_per_node=nproc,
                          max_restarts=max_restarts, start_method="fork", **rdzv)
    env = {**env, **_cpu_threads(nproc)}
    # torch's launch_agent sets TORCHELASTIC_SIGNALS_TO_HANDLE in the caller's environment,
    # and with restarts the c10d store must not be shared (see accel.launch.run): the
    # caller's values are put back afterwards.
    names = ("TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    before = environ_snapshot()
    saved = {name: before.get(name) for name in names}
    if max_restarts > 0 and rdzv["rdzv_backend"] == "c10d":
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    what = f"{name}({getattr(function, '__name__', 'function')})"
    try:
        with tempfile.TemporaryDirectory(prefix="accel-launch-") as reports:
            try:
                results = elastic_launch(config, _run_in_worker)(
                    function, tuple(args), env, reports
                )
            except ChildFailedError as error:
                noticed = {failure.pid for failure in error.failures.values()}
                first = _first_report(reports, noticed)
                if first is None:
                    text, _ = describe_failure(error, what)
                    message = text.rstrip("\n").replace("accel launch: ", "")
                else:
                    message = (f"{what} failed: rank {first['rank']} raised.\n"
                               f"----- traceback of rank {first['rank']} -----\n"
                               f"{first['traceback'].rstrip()}")
                raise LaunchError(message) from None
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
    return [results[rank] for rank in sorted(results)] if results else []


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    num_processes: int | None = None,
    mixed_precision: str = "no",
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    max_restarts: int = 0,
    **unknown: Any,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` processes per machine, from a notebook.

    Workers are forked through torch's elastic launcher: the function may be defined in the
    notebook. Inside it, ``with accel.distributed():`` joins the job (``mixed_precision``
    reaches it through ``ACCEL_MIXED_PRECISION``). On one machine a free port is chosen.

    Args:
        function: the training function; runs on every process.
        args: positional arguments for it.
        num_processes: processes on this machine (default: one per GPU, else 2 on CPU).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (torchao float8
            Linear layers).
        num_nodes: machines in the job (run the same cell on each).
        node_rank: rank of this machine.
        master_addr: address of machine 0 (several machines).
        master_port: port on machine 0 (default: free port on one machine, else 29500).
        max_restarts: times the whole job restarts after a process fails.
        **unknown: refused (a misspelt option is a ``ConfigError`` naming the closest one).

    Returns:
        The function's return value on each process of this machine, by local rank.

    Raises:
        LaunchError: CUDA is already initialised here, this process is itself a launched
            worker, or a worker failed (the message has its rank and traceback).
        ConfigError: an invalid argument.

    Example:
        >>> def train(lr):
        ...     with accel.distributed():
        ...         return accel.state().rank
        >>> notebook_launcher(train, (0.1,), num_processes=2)
        [0, 1]
    """
    for key in unknown:
        known = ("args", "num_processes", "mixed_precision", "num_nodes", "node_rank",
                 "master_addr", "master_port", "max_restarts")
        raise ConfigError(
            f"notebook_launcher() got an unknown option {key!r}{did_you_mean(key, known)}; "
            f"it takes {list(known)}. Settings such as the strategy go to "
            "`accel.distributed(...)` inside the function."
        )
    _count("num_nodes", num_nodes, 1)
    _count("max_restarts", max_restarts, 0)
    if not isinstance(node_rank, int) or not 0 <= node_rank < num_nodes:
        raise ConfigError(
            f"node_rank={node_rank!r} must be in 0..{num_nodes - 1} for num_nodes={num_nodes}."
        )
    precision = str(mixed_precision).lower()
    if precision not in MIXED_PRECISION_MODES:
        raise ConfigError(
            f"mixed_precision={mixed_precision!r} is not supported; choose one of "
            f"{list(MIXED_PRECISION_MODES)}, e.g. `notebook_launcher(fn, mixed_precision='bf16')`."
        )
    _refuse_unsafe_parent("notebook_launcher")
    if num_processes is None:
        import torch

        # device_count() asks NVML first, which (unlike is_available()) leaves fork usable
        num_processes = torch.cuda.device_count() or DEFAULT_CPU_PROCESSES
    _count("num_processes", num_processes, 1)
    return _launch(function, args, nproc=num_processes, num_nodes=num_nodes,
                   node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                   max_restarts=max_restarts,
                   env={env_variable("mixed_precision"): precision}, name="notebook_launcher")


def debug_launcher(
    function: Callable[..., Any], args: Sequence[Any] = (), *, num_processes: int = 2
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU processes over gloo (for tests).

    Args:
        function: runs on every process; ``with accel.distributed():`` inside joins the job.
        args: positional arguments for it.
        num_processes: how many CPU processes.

    Returns:
        The function's return value on each process, by rank.

    Raises:
        LaunchError: called from a launched worker, or a worker failed.

    Example:
        >>> def body():
        ...     with accel.distributed():
        ...         return accel.gather(torch.tensor([accel.state().rank])).tolist()
        >>> debug_launcher(body)
        [[0, 1], [0, 1]]
    """
    _count("num_processes", num_processes, 1)
    _refuse_unsafe_parent("debug_launcher", cuda_matters=False)  # CPU workers only
    env = {env_variable("cpu"): "1", env_variable("backend"): "gloo"}
    return _launch(function, args, nproc=num_processes, num_nodes=1, node_rank=0,
                   master_addr="127.0.0.1", master_port=None, max_restarts=0, env=env,
                   name="debug_launcher")

"""The launch environment: the only module that reads ``os.environ``.

It turns the variables that torchrun / ``accel launch``, SLURM and Open MPI / MPICH set into a
frozen :class:`LaunchEnv`. Nothing here writes to the environment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Literal

import attrs

from accel.errors import ConfigError

__all__ = ["ENV_PREFIX", "LaunchEnv", "Launcher", "environ_snapshot", "read_launch_env"]

Launcher = Literal["torchrun", "slurm", "mpi", "none"]

ENV_PREFIX = "ACCEL_"
"""Prefix of the variables through which ``accel launch`` passes options to the workers."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_DEFAULT_PORT = 29500


@attrs.frozen(kw_only=True)
class LaunchEnv:
    """What the launcher told this process: its place in the job and accel's options.

    Option fields are ``None`` when the environment does not set them.
    """

    launcher: Launcher = "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    mixed_precision: str | None = None
    gradient_accumulation_steps: int | None = None
    strategy: str | None = None
    backend: str | None = None
    cpu: bool | None = None
    debug: bool | None = None
    timeout: float | None = None
    config_file: str | None = None


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(
            f"Environment variable {name}={raw!r} is not an integer. "
            f"Unset it or give a whole number, e.g. `{name}=2`."
        ) from None


def _float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigError(
            f"Environment variable {name}={raw!r} is not a number of seconds. "
            f"Unset it or give a number, e.g. `{name}=1800`."
        ) from None


def _bool(env: Mapping[str, str], name: str) -> bool | None:
    raw = env.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"Environment variable {name}={raw!r} is not a boolean. "
        f"Use one of {sorted(_TRUE | _FALSE - {''})}, e.g. `{name}=1`."
    )


def _str(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    first = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist.strip())
    if first is None:
        raise ConfigError(
            f"Cannot read the SLURM node list {nodelist!r}. "
            "Set `MASTER_ADDR` to the first node's address."
        )
    prefix, _, ranges = first.groups()
    if not ranges:
        return prefix
    start = ranges.split(",")[0].split("-")[0]
    return prefix + start


def _slurm_tasks_per_node(env: Mapping[str, str], world: int, nodes: int) -> int:
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
        raw = env.get(name)
        if raw:
            match = re.match(r"\d+", raw)
            if match:
                return int(match.group())
    return max(1, world // max(1, nodes))


def _from_torchrun(env: Mapping[str, str]) -> dict[str, object] | None:
    world = _int(env, "WORLD_SIZE")
    rank = _int(env, "RANK")
    if world is None or rank is None:
        return None
    local_rank = _int(env, "LOCAL_RANK")
    local_world = _int(env, "LOCAL_WORLD_SIZE")
    if local_rank is None:
        local_rank = rank
    if local_world is None:
        local_world = world
    nodes = _int(env, "GROUP_WORLD_SIZE") or max(1, world // max(1, local_world))
    node_rank = _int(env, "GROUP_RANK")
    if node_rank is None:
        node_rank = _int(env, "NODE_RANK")
    if node_rank is None:
        node_rank = rank // max(1, local_world)
    return {
        "launcher": "torchrun",
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "local_world_size": local_world,
        "node_rank": node_rank,
        "num_nodes": nodes,
        "master_addr": _str(env, "MASTER_ADDR"),
        "master_port": _int(env, "MASTER_PORT"),
    }


def _from_slurm(env: Mapping[str, str]) -> dict[str, object] | None:
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_NTASKS")
    if rank is None or world is None or world <= 1:
        return None
    # An interactive allocation (salloc + python) is not an srun step of N tasks.
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive") and "SLURM_STEP_ID" not in env:
        return None
    nodes = _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES") or 1
    local_world = _slurm_tasks_per_node(env, world, nodes)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    addr = _str(env, "MASTER_ADDR") or (_first_slurm_host(nodelist) if nodelist else "127.0.0.1")
    port = _int(env, "MASTER_PORT")
    if port is None:
        job_id = _int(env, "SLURM_JOB_ID") or 0
        port = 15000 + job_id % 20000  # same for every task of the job, spread across jobs
    local_rank = _int(env, "SLURM_LOCALID")
    node_rank = _int(env, "SLURM_NODEID")
    return {
        "launcher": "slurm",
        "rank": rank,
        "local_rank": local_rank if local_rank is not None else rank % local_world,
        "world_size": world,
        "local_world_size": local_world,
        "node_rank": node_rank if node_rank is not None else rank // local_world,
        "num_nodes": nodes,
        "master_addr": addr,
        "master_port": port,
    }


_MPI_VARIABLES = (
    # (rank, size, local rank, local size) for Open MPI, then MPICH / Intel MPI (PMI)
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _from_mpi(env: Mapping[str, str]) -> dict[str, object] | None:
    for rank_var, size_var, local_var, local_size_var in _MPI_VARIABLES:
        rank = _int(env, rank_var)
        world = _int(env, size_var)
        if rank is None or world is None:
            continue
        local_world = _int(env, local_size_var) or world
        local_rank = _int(env, local_var)
        nodes = max(1, -(-world // local_world))
        addr = _str(env, "MASTER_ADDR")
        if addr is None:
            if nodes > 1:
                raise ConfigError(
                    f"The job was started by MPI on {nodes} nodes ({size_var}={world}) but "
                    "MASTER_ADDR is not set. Export `MASTER_ADDR=<address of rank 0's node>` "
                    "(and optionally `MASTER_PORT`) to every rank, e.g. `mpirun -x MASTER_ADDR`."
                )
            addr = "127.0.0.1"
        return {
            "launcher": "mpi",
            "rank": rank,
            "local_rank": local_rank if local_rank is not None else rank % local_world,
            "world_size": world,
            "local_world_size": local_world,
            "node_rank": rank // local_world,
            "num_nodes": nodes,
            "master_addr": addr,
            "master_port": _int(env, "MASTER_PORT") or _DEFAULT_PORT,
        }
    return None


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launch environment (``os.environ`` unless a mapping is given).

    torchrun-style variables win over SLURM, which wins over MPI; with none of them the
    process is a single process.

    Example:
        >>> read_launch_env({"RANK": "1", "WORLD_SIZE": "2"}).rank
        1
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    placement = _from_torchrun(env) or _from_slurm(env) or _from_mpi(env) or {}
    p = ENV_PREFIX
    launch = LaunchEnv(
        mixed_precision=_str(env, p + "MIXED_PRECISION"),
        gradient_accumulation_steps=_int(env, p + "GRADIENT_ACCUMULATION_STEPS"),
        strategy=_str(env, p + "STRATEGY"),
        backend=_str(env, p + "BACKEND"),
        cpu=_bool(env, p + "CPU"),
        debug=_bool(env, p + "DEBUG"),
        timeout=_float(env, p + "TIMEOUT"),
        config_file=_str(env, p + "CONFIG_FILE"),
        **placement,  # type: ignore[arg-type]
    )
    _check_placement(launch)
    return launch


def environ_snapshot() -> dict[str, str]:
    """A copy of the whole environment (for launchers that start processes elsewhere)."""
    return dict(os.environ)


def _check_placement(launch: LaunchEnv) -> None:
    if launch.world_size < 1:
        raise ConfigError(
            f"The launcher set a world size of {launch.world_size!r}; it must be >= 1. "
            "Check WORLD_SIZE (or SLURM_NTASKS / the MPI size)."
        )
    if not 0 <= launch.rank < launch.world_size:
        raise ConfigError(
            f"The launcher set rank {launch.rank!r} outside 0..{launch.world_size - 1} "
            f"(world size {launch.world_size}). Check RANK and WORLD_SIZE."
        )
    if not 0 <= launch.local_rank < max(1, launch.local_world_size):
        raise ConfigError(
            f"The launcher set local rank {launch.local_rank!r} outside "
            f"0..{launch.local_world_size - 1}. Check LOCAL_RANK and LOCAL_WORLD_SIZE."
        )

"""The launch environment: the only module that reads ``os.environ``.

It turns the variables that torchrun / ``accel launch``, SLURM and Open MPI / MPICH set into a
frozen :class:`LaunchEnv`. Nothing here writes to the environment.

The rendezvous port under SLURM and MPI (which, unlike torchrun, host no store of their own) is
``MASTER_PORT`` when set. Otherwise it is derived from the id of the job, which every rank of
the job sees alike, so two jobs sharing a node do not both take torch's 29500:

- the id is, for SLURM, ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``; for MPI the first set of
  ``PMIX_NAMESPACE`` (Open MPI 5, PMIx launchers), ``OMPI_MCA_ess_base_jobid`` (Open MPI 4),
  ``PMI_JOBID`` (Slurm's PMI2), ``SLURM_JOB_ID`` (+ ``SLURM_STEP_ID``), ``PBS_JOBID``,
  ``LSB_JOBID``;
- an id ``J`` or ``J.S`` in digits counts as ``n = J + 1000 * S`` (consecutive jobs get
  consecutive ports); any other id as ``n = crc32(id)``;
- the port is ``20000 + n % 12768``, i.e. within 20000..32767 (:data:`DERIVED_PORT_RANGE`):
  unprivileged and below Linux's default ephemeral range (32768..60999), from which outgoing
  connections take their local ports.

Without any id (e.g. MPICH's ``mpiexec`` on a workstation) the port is 29500
(:data:`DEFAULT_PORT`), and two such jobs on one node need distinct ``MASTER_PORT`` values.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from typing import Literal

import attrs

from accel.core.setting_values import validate_setting
from accel.core.settings import DEFAULT_PORT, ENV_PREFIX, POLICY_KEYS, env_variable
from accel.errors import ConfigError

__all__ = [
    "DERIVED_PORT_RANGE",
    "LaunchEnv",
    "Launcher",
    "environ_snapshot",
    "read_launch_env",
    "read_variable",
]

Launcher = Literal["torchrun", "slurm", "mpi", "none"]

DERIVED_PORT_RANGE = (20000, 32767)
"""The inclusive range of rendezvous ports derived from a SLURM or MPI job id."""

_MPI_JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID")
_SCHEDULER_JOB_IDS = ("PBS_JOBID", "LSB_JOBID")


@attrs.frozen(kw_only=True)
class LaunchEnv:
    """What the launcher told this process: its place in the job and accel's options.

    Option fields (one per policy key of :data:`accel.core.settings.SETTINGS`, read from
    ``ACCEL_<KEY>`` and checked as in the config file) are ``None`` when the environment does
    not set them.
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
    arrival_timeout: float | None = None
    heartbeat_interval: float | None = None
    liveness_timeout: float | None = None
    on_each_node: bool | None = None
    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    pp_size: int | None = None
    cp_method: str | None = None
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


def _setting(env: Mapping[str, str], key: str) -> object:
    """The policy setting ``key`` from ``ACCEL_<KEY>``, checked and typed; ``None`` if unset.

    A blank variable counts as unset. Kinds, choices, ranges and boolean spellings are those
    of :data:`accel.core.settings.SETTINGS`, as in the config file.
    """
    name = env_variable(key)
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    return validate_setting(key, raw, name, variable=name)


def _str(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


def _port(env: Mapping[str, str]) -> int | None:
    """``MASTER_PORT`` as an int (``None`` when unset), refused outside 1..65535."""
    port = _int(env, "MASTER_PORT")
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(
            f"Environment variable MASTER_PORT={env['MASTER_PORT']!r} is not a TCP port; "
            "it must be in 1..65535. Unset it (SLURM and MPI jobs then derive one from the "
            "job id) or give a free port, e.g. `MASTER_PORT=29500`."
        )
    return port


def _slurm_job_id(env: Mapping[str, str]) -> str | None:
    """``"<job>"`` or ``"<job>.<step>"`` for a SLURM job, ``None`` outside one."""
    job = _str(env, "SLURM_JOB_ID") or _str(env, "SLURM_JOBID")
    if job is None:
        return None
    step = _str(env, "SLURM_STEP_ID") or _str(env, "SLURM_STEPID")
    return f"{job}.{step}" if step is not None and step.isdigit() else job


def _port_from_job_id(job_id: str | None) -> int:
    """The rendezvous port for a job id (see the module docstring for the formula)."""
    if job_id is None:
        return DEFAULT_PORT
    low, high = DERIVED_PORT_RANGE
    numeric = re.fullmatch(r"(\d+)(?:\.(\d+))?", job_id)
    if numeric is not None:
        n = int(numeric.group(1)) + 1000 * int(numeric.group(2) or 0)
    else:
        n = zlib.crc32(job_id.encode("utf-8"))
    return low + n % (high - low + 1)


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
        "master_port": _port(env),
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
    nodelist = (
        _str(env, "SLURM_STEP_NODELIST")
        or _str(env, "SLURM_JOB_NODELIST")
        or _str(env, "SLURM_NODELIST")
        or ""
    )
    addr = _str(env, "MASTER_ADDR") or (_first_slurm_host(nodelist) if nodelist else "127.0.0.1")
    port = _port(env)
    if port is None:  # the same on every task of the job step, different across jobs
        port = _port_from_job_id(_slurm_job_id(env))
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


def _mpi_job_id(env: Mapping[str, str]) -> str | None:
    """The id every rank of an MPI job shares (MPI's own first, then the scheduler's)."""
    for name in _MPI_JOB_IDS:
        value = _str(env, name)
        if value is not None:
            return value
    slurm = _slurm_job_id(env)
    if slurm is not None:
        return slurm
    for name in _SCHEDULER_JOB_IDS:
        value = _str(env, name)
        if value is not None:
            return value
    return None


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
        port = _port(env)
        if port is None:  # the same on every rank of the job, different across jobs
            port = _port_from_job_id(_mpi_job_id(env))
        return {
            "launcher": "mpi",
            "rank": rank,
            "local_rank": local_rank if local_rank is not None else rank % local_world,
            "world_size": world,
            "local_world_size": local_world,
            "node_rank": rank // local_world,
            "num_nodes": nodes,
            "master_addr": addr,
            "master_port": port,
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
    options = {key: _setting(env, key) for key in POLICY_KEYS}
    launch = LaunchEnv(
        config_file=_str(env, ENV_PREFIX + "CONFIG_FILE"),
        **options,  # type: ignore[arg-type]
        **placement,  # type: ignore[arg-type]
    )
    _check_placement(launch)
    return launch


def read_variable(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """One environment variable, stripped; ``None`` when unset or blank.

    For the few settings other modules must honour as the user set them (e.g. ``WANDB_MODE``
    for the wandb tracker), so that reading ``os.environ`` stays in this module.

    Example:
        >>> read_variable("WANDB_MODE", {"WANDB_MODE": " offline "})
        'offline'
    """
    return _str(os.environ if environ is None else environ, name)


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

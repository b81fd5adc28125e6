"""The process state: one frozen value in one ContextVar.

``distributed()`` sets it for a block; every accel function reads it with :func:`state`.
Outside any block the state is derived on each call from what already exists (an initialised
process group, the launch environment) without side effects.
"""

from __future__ import annotations

import contextvars
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, NoReturn

import attrs
import torch

from accel.core.engine_facts import ENGINE_FACTS
from accel.core.env import LaunchEnv, read_launch_env
from accel.core.scope import Scope, enter_scope, leave_scope
from accel.core.settings import (
    DEFAULT_ARRIVAL_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    MIXED_PRECISION_MODES,
    CpMethod,
    MixedPrecision,
    Strategy,
)
from accel.errors import ConfigError, StateFrozenError

__all__ = [
    "Place",
    "ProcessState",
    "best_device",
    "current_gate",
    "derive_state",
    "find_place",
    "gated",
    "has_active_state",
    "resolve_policy",
    "set_state",
    "state",
]

_MIXED_PRECISION = MIXED_PRECISION_MODES


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


@attrs.frozen(kw_only=True)
class ProcessState:
    """Where this process stands in the job, and the run-wide training policy.

    Immutable: make a changed copy with ``attrs.evolve`` or a nested ``accel.distributed(...)``.
    Setting or deleting an attribute raises :class:`~accel.errors.StateFrozenError`.

    Example:
        >>> st = accel.state()
        >>> st.rank, st.world_size, st.is_main_process
        (0, 1, True)
    """

    rank: int = 0
    """This process's global rank, ``0`` to ``world_size - 1``."""
    local_rank: int = 0
    """This process's rank on its machine, ``0`` to ``local_world_size - 1``."""
    world_size: int = 1
    """The number of processes in the job."""
    local_world_size: int = 1
    """The number of processes on this machine."""
    node_rank: int = 0
    """This machine's index, ``0`` to ``num_nodes - 1``."""
    num_nodes: int = 1
    """The number of machines in the job."""
    hostname: str = attrs.field(factory=socket.gethostname)
    """The name of the machine this process runs on (``socket.gethostname()``)."""
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    """The device this process computes on (its GPU, or the CPU)."""
    backend: str | None = None
    """The ``torch.distributed`` backend (``"nccl"``, ``"gloo"``...), ``None`` on one process."""
    mixed_precision: MixedPrecision = "no"
    """``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``."""
    gradient_accumulation_steps: int = 1
    """Batches per optimizer step."""
    strategy: Strategy = "none"
    """The engine: ``"none"`` (one process), ``"ddp"``, ``"fsdp"`` or ``"deepspeed"``."""
    debug: bool = False
    """Whether every collective is first checked across ranks (operation, shapes, dtypes)."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds accel's own waits allow (the debug checks, ``wait_for_everyone``)."""
    arrival_timeout: float = DEFAULT_ARRIVAL_TIMEOUT_S
    """Seconds a rank waits at a call every rank must make (``save_state``, ``load_state``...)
    for the others before naming those that never arrived (``accel.core.arrival``)."""
    seed: int | None = None
    """The seed every rank's python, numpy and torch generators got, or ``None``."""
    on_each_node: bool = False
    """Whether each machine's local main process writes and reads its own copy of files."""
    options: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_frozen_mapping, eq=False, repr=False
    )
    """The block's engine options (DDP's ``find_unused_parameters``, ``comm_hook``...; FSDP's
    ``shard_modules``...), read-only."""
    mesh_shape: tuple[int, int, int, int, int] | None = None
    """``(pp, dp_replicate, dp_shard, cp, tp)`` sizes when the block has a device mesh."""
    mesh: Any = attrs.field(default=None, eq=False, repr=False)
    """The block's torch ``DeviceMesh`` (dims ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``,
    ``tp``), or None."""
    cp_method: CpMethod | None = None
    """How attention is split under context parallelism (``"alltoall"`` or ``"ring"``);
    ``None`` without a ``cp`` dim > 1."""

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        """True on the highest global rank."""
        return self.rank == self.world_size - 1

    @property
    def use_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    @property
    def tp_world_size(self) -> int:
        """Processes in this rank's tensor-parallel group (1 without a ``tp`` mesh dim)."""
        return 1 if self.mesh_shape is None else self.mesh_shape[4]

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group (the mesh's innermost dim)."""
        return self.rank % self.tp_world_size

    @property
    def cp_world_size(self) -> int:
        """Processes that split one sequence (1 without a ``cp`` mesh dim)."""
        return 1 if self.mesh_shape is None else self.mesh_shape[3]

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group: which piece of each sequence."""
        return (self.rank // self.tp_world_size) % self.cp_world_size

    @property
    def pp_world_size(self) -> int:
        """Pipeline stages (ranks) a model is split over (1 without a ``pp`` mesh dim)."""
        return 1 if self.mesh_shape is None else self.mesh_shape[0]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage group (the mesh's outermost dim)."""
        return self.rank // (self.world_size // self.pp_world_size)

    @property
    def dp_world_size(self) -> int:
        """Processes that see different batches: ``world_size / (pp * cp * tp)``."""
        return self.world_size // (self.pp_world_size * self.cp_world_size * self.tp_world_size)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which share of the batches it sees (every
        pipeline stage, context-parallel and tensor-parallel rank of a replica sees the same)."""
        return (self.rank // (self.cp_world_size * self.tp_world_size)) % self.dp_world_size


# What to write instead of assigning to a state attribute.
_NESTED = ("mixed_precision", "gradient_accumulation_steps", "strategy", "debug", "timeout",
           "arrival_timeout", "on_each_node")
_LAUNCH_FACTS = ("rank", "local_rank", "world_size", "local_world_size", "node_rank",
                 "num_nodes", "hostname", "is_main_process", "is_local_main_process",
                 "is_last_process", "use_distributed", "tp_world_size", "tp_rank",
                 "cp_world_size", "cp_rank",
                 "dp_world_size", "dp_rank", "pp_world_size", "pp_rank")
_OUTERMOST = {
    "backend": "`accel.distributed(backend=...)`",
    "device": "`accel.distributed(cpu=True)` (or the launcher's device choice)",
    "seed": "`accel.distributed(seed=...)`",
    "mesh": "`accel.distributed(dp_shard_size=..., tp_size=..., pp_size=...)`",
    "mesh_shape": "`accel.distributed(dp_shard_size=..., tp_size=..., pp_size=...)`",
    "cp_method": "`accel.distributed(cp_size=..., cp_method=...)`",
}


def _frozen_advice(name: str, value: object, verb: str) -> str:
    head = f"accel.state() is immutable: cannot {verb} {name!r}"
    if verb == "set":
        head += f" to {value!r}"
    shown = "n" if verb == "delete" else repr(value)
    if name in _NESTED:
        return (
            f"{head}. Change it for a block instead: "
            f"`with accel.distributed({name}={shown}):` nested inside the outer block."
        )
    if name in _LAUNCH_FACTS:
        return f"{head}: {name} is a fact of the launch and cannot change."
    if name in _OUTERMOST:
        return (
            f"{head}: it is chosen once, by the outermost {_OUTERMOST[name]}; "
            "nested blocks reuse the process group."
        )
    if name == "options":
        return (
            f"{head}. Pass extra options as keywords of a nested block: "
            "`with accel.distributed(my_option=value):`."
        )
    return (
        f"{head}: ProcessState has no field {name!r} (fields: "
        f"{[field.name for field in attrs.fields(ProcessState)]})."
    )


def _refuse_setattr(self: ProcessState, name: str, value: object) -> NoReturn:
    raise StateFrozenError(_frozen_advice(name, value, "set"))


def _refuse_delattr(self: ProcessState, name: str) -> NoReturn:
    raise StateFrozenError(_frozen_advice(name, None, "delete"))


# attrs writes its own refusing __setattr__/__delattr__ on frozen classes (and builds, copies
# and evolves instances with object.__setattr__), so the explaining ones replace them here.
ProcessState.__setattr__ = _refuse_setattr  # type: ignore[method-assign,assignment]
ProcessState.__delattr__ = _refuse_delattr  # type: ignore[method-assign,assignment]


_STATE: contextvars.ContextVar[ProcessState] = contextvars.ContextVar("accel_state")
_GATE: contextvars.ContextVar[str | None] = contextvars.ContextVar("accel_gate", default=None)


def state() -> ProcessState:
    """The current process state.

    Inside ``with accel.distributed(...)`` it is the block's state; outside it is derived from
    an initialised ``torch.distributed`` group or the launch environment, with no side effects.

    Example:
        >>> if accel.state().is_main_process:
        ...     print("only once")
    """
    current = _STATE.get(None)
    if current is not None:
        return current
    return derive_state()


def has_active_state() -> bool:
    """Whether a ``distributed()`` block (or a test override) is active in this context."""
    return _STATE.get(None) is not None


@contextmanager
def set_state(new: ProcessState, new_scope: Scope | None = None) -> Iterator[ProcessState]:
    """Make ``new`` the state (and ``new_scope`` the scope) for the block, then restore."""
    token = _STATE.set(new)
    scope_token = enter_scope(new_scope) if new_scope is not None else None
    try:
        yield new
    finally:
        if scope_token is not None:
            leave_scope(scope_token)
        _STATE.reset(token)


def current_gate() -> str | None:
    """The description of the rank gate this code runs inside, or ``None``."""
    return _GATE.get()


@contextmanager
def gated(description: str) -> Iterator[None]:
    """Mark the block as running on a subset of ranks (collectives inside raise)."""
    token = _GATE.set(description)
    try:
        yield
    finally:
        _GATE.reset(token)


def best_device(local_rank: int, *, cpu: bool = False) -> torch.device:
    """CUDA device ``local_rank % device_count`` when CUDA is usable, else the CPU."""
    if not cpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _choice(name: str, value: str, choices: tuple[str, ...], example: str) -> str:
    if value not in choices:
        raise ConfigError(
            f"{name}={value!r} is not supported; choose one of {list(choices)}, "
            f"e.g. `accel.distributed({name}={example!r})`."
        )
    return value


def _seconds(name: str, raw: object, default: float, example: int) -> float:
    """A positive, finite number of seconds (``default`` when ``raw`` is ``None``)."""
    try:
        value = default if raw is None else float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        value = -1.0
    if isinstance(raw, bool) or not 0 < value < float("inf"):
        raise ConfigError(
            f"{name}={raw!r} must be a positive number of seconds, "
            f"e.g. `accel.distributed({name}={example})`."
        )
    return value


def resolve_policy(
    env: LaunchEnv,
    *,
    world_size: int,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int | None = None,
    strategy: str | None = None,
    debug: bool | None = None,
    timeout: float | None = None,
    arrival_timeout: float | None = None,
) -> dict[str, Any]:
    """Resolve the policy fields: explicit argument, then the environment, then defaults."""
    mp = mixed_precision if mixed_precision is not None else env.mixed_precision
    mp = _choice("mixed_precision", (mp or "no").lower(), _MIXED_PRECISION, "bf16")
    gas = gradient_accumulation_steps
    if gas is None:
        gas = env.gradient_accumulation_steps if env.gradient_accumulation_steps else 1
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ConfigError(
            f"gradient_accumulation_steps={gas!r} must be an integer >= 1, "
            "e.g. `accel.distributed(gradient_accumulation_steps=4)`."
        )
    strat = strategy if strategy is not None else env.strategy
    if strat is None:
        strat = "ddp" if world_size > 1 else "none"
    strat = _choice("strategy", strat.lower(), tuple(ENGINE_FACTS), "ddp")
    if debug is not None and not isinstance(debug, bool):
        raise ConfigError(
            f"debug={debug!r} must be True or False, e.g. `accel.distributed(debug=True)`."
        )
    dbg = debug if debug is not None else bool(env.debug)
    to = _seconds("timeout", timeout if timeout is not None else env.timeout,
                  DEFAULT_TIMEOUT_S, 600)
    arrival = _seconds(
        "arrival_timeout",
        arrival_timeout if arrival_timeout is not None else env.arrival_timeout,
        DEFAULT_ARRIVAL_TIMEOUT_S, 120,
    )
    return {
        "mixed_precision": mp,
        "gradient_accumulation_steps": gas,
        "strategy": strat,
        "debug": dbg,
        "timeout": to,
        "arrival_timeout": arrival,
    }


@attrs.frozen
class Place:
    """Where this process stands: its ranks, its device and the backend of the process group it
    is in (``None`` without one)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None


def find_place(env: LaunchEnv, *, cpu: bool = False) -> Place:
    """This process from an initialised ``torch.distributed`` group, else from the launch
    environment; reads, never initialises anything. Used inside and outside blocks alike.

    Example:
        >>> find_place(read_launch_env(), cpu=True).device
        device(type='cpu')
    """
    rank, world = env.rank, env.world_size
    local_rank, local_world = env.local_rank, env.local_world_size
    backend: str | None = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
        backend = str(torch.distributed.get_backend())
        if env.world_size != world:  # group not made from this environment: one node
            local_rank, local_world = rank, world
    device = best_device(local_rank, cpu=cpu or backend == "gloo")
    return Place(rank, world, local_rank, local_world, device, backend)


def derive_state(env: LaunchEnv | None = None) -> ProcessState:
    """The state outside any ``distributed()`` block; reads, never initialises anything."""
    env = read_launch_env() if env is None else env
    place = find_place(env, cpu=bool(env.cpu))
    world, local_world = place.world_size, place.local_world_size
    return ProcessState(
        rank=place.rank,
        local_rank=place.local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=place.rank // max(1, local_world),
        num_nodes=max(1, -(-world // max(1, local_world))),
        device=place.device,
        backend=place.backend,
        on_each_node=bool(env.on_each_node),
        **resolve_policy(env, world_size=world),
    )

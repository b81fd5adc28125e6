"""``distributed()``: set up (or join) the process group and set the state for a block."""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import attrs
import torch
import torch.distributed as dist

from accel.core.agreement import agree_on_settings, settings_of
from accel.core.config_file import deepspeed_policy, load_config
from accel.core.engine_facts import ENGINE_FACTS, SHARDING_ENGINE, EngineFacts
from accel.core.env import LaunchEnv, read_launch_env, read_variable
from accel.core.exit_refs import final_barrier
from accel.core.global_batch import keep_global_batch
from accel.core.liveness import LivenessBounds, Watch, liveness_bounds, start_watch
from accel.core.mesh import SIZE_KEYS, build_mesh, mesh_shape
from accel.core.options import check_options
from accel.core.scope import Scope, run_exit_steps
from accel.core.seeding import set_seed
from accel.core.setting_values import validate_setting
from accel.core.settings import (
    BACKENDS,
    CP_METHODS,
    DDP_CONFIG_KEYS,
    DEFAULT_PORT,
    MODEL_KEYS,
    POLICY_KEYS,
    CpMethod,
    env_variable,
)
from accel.core.state import (
    Place,
    ProcessState,
    find_place,
    has_active_state,
    resolve_policy,
    set_state,
    state,
)
from accel.errors import CollectiveMismatchError, CollectiveTimeoutError, ConfigError

__all__ = ["distributed"]


def _as_seconds(timeout: float | datetime.timedelta | None) -> float | None:
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return timeout


def _pick_backend(requested: str | None, device: torch.device) -> str:
    backend = requested or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise ConfigError(
            f"backend={backend!r} is not a torch.distributed backend; choose one of "
            f"{list(BACKENDS)}, e.g. `accel.distributed(backend='gloo')` for CPU."
        )
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "backend='nccl' needs CUDA devices, but this process runs on "
            f"{str(device)!r}. Use `backend='gloo'` (the CPU default) or drop `cpu=True`."
        )
    return backend


def _init_group(env: LaunchEnv, backend: str, timeout_s: float) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.launcher == "torchrun":
        # torchrun's agent already hosts the store at MASTER_ADDR:MASTER_PORT: join it.
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    addr = env.master_addr or "127.0.0.1"
    port = env.master_port or DEFAULT_PORT
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )


def _nested(
    current: ProcessState,
    *,
    fixed: dict[str, Any],
    changes: dict[str, Any],
    options: dict[str, Any],
    on_each_node: bool | None,
) -> ProcessState:
    held_values = {"backend": current.backend, "cpu": current.device.type == "cpu"}
    for name, value in fixed.items():
        if value is not None and value != held_values[name]:
            raise ConfigError(
                f"A nested `accel.distributed()` cannot change {name} (outer block: "
                f"{held_values[name]!r}, requested: {value!r}): it reuses the outer process "
                f"group. Pass {name} to the outermost `accel.distributed()` instead."
            )
    merged = {k: v if v is not None else getattr(current, k) for k, v in changes.items()}
    policy = resolve_policy(LaunchEnv(), world_size=current.world_size, **merged)
    policy = keep_global_batch(  # a nested block's own steps are for the reference world too
        policy, {**current.options, **options}, world_size=current.world_size,
        rank=current.rank, given=changes["gradient_accumulation_steps"] is not None,
    )
    each = current.on_each_node if on_each_node is None else on_each_node
    return attrs.evolve(
        current, **policy, on_each_node=each, options={**current.options, **options}
    )


def _check_on_each_node(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(
        f"on_each_node={value!r} must be True or False, e.g. "
        "`accel.distributed(on_each_node=True)` when the machines have no shared filesystem."
    )


def _check_backend_and_cpu(backend: object, cpu: object) -> None:
    """Refuse a bad ``backend``/``cpu`` on one process too (N processes would fail)."""
    if not isinstance(cpu, bool):
        raise ConfigError(
            f"cpu={cpu!r} must be True or False, e.g. `accel.distributed(cpu=True)`."
        )
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(
            f"backend={backend!r} is not a torch.distributed backend; choose one of "
            f"{list(BACKENDS)}, e.g. `accel.distributed(backend='gloo')` for CPU."
        )


@contextmanager
def distributed(
    *,
    backend: str | None = None,
    mixed_precision: str | None = None,
    gradient_accumulation_steps: int | None = None,
    strategy: str | None = None,
    cpu: bool = False,
    timeout: float | datetime.timedelta | None = None,
    arrival_timeout: float | datetime.timedelta | None = None,
    debug: bool | None = None,
    seed: int | None = None,
    on_each_node: bool | None = None,
    dp_replicate_size: int | None = None,
    dp_shard_size: int | None = None,
    tp_size: int | None = None,
    cp_size: int | None = None,
    pp_size: int | None = None,
    cp_method: str | None = None,
    heartbeat_interval: float | None = None,
    liveness_timeout: float | None = None,
    **options: Any,
) -> Iterator[ProcessState]:
    """Set up distributed training for the block and yield the process state.

    Reads the launch environment (torchrun / ``accel launch``, SLURM, Open MPI / MPICH), picks
    the device (CUDA ``local_rank % device_count``, else CPU) and the backend (nccl on CUDA,
    gloo on CPU), initialises the process group unless one exists, and destroys on exit only a
    group it created: after a barrier on a clean exit, and at once, with no collective, when an
    exception leaves the block (the failing rank exits promptly, so its launcher stops the job
    instead of every rank waiting for the collective timeout). Options not passed come from the
    ``ACCEL_*`` environment, then the config file, then defaults. Nested inside an active
    block, it reuses the group and scopes the changed options.

    Args:
        backend: torch.distributed backend; default nccl on CUDA, gloo on CPU.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (torchao's float8
            training of the ``nn.Linear`` layers, bf16 autocast around them; needs the extra
            ``accel[fp8]``; recipe ``fp8_recipe=`` below). Checked here; what each mode does
            is its unit's, in ``accel.precision``.
        gradient_accumulation_steps: optimizer steps happen every this many batches.
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"`` or ``"deepspeed"`` (DeepSpeed's engine
            from the user's config, extra ``accel[deepspeed]``: ``deepspeed_config=`` a JSON
            path or dict, ``zero_stage=``, ``offload_optimizer=``, ``offload_params=``,
            ``gradient_clipping=``, see ``docs/deepspeed.md``); default ddp with several
            processes.
        cpu: run on the CPU even when CUDA is available.
        timeout: seconds (or a timedelta) before a collective gives up; default 30 minutes.
            A nested block can shorten it for accel's own waits (debug-mode checks); the
            process group keeps the timeout it was created with.
        arrival_timeout: seconds (or a timedelta) a rank waits at ``save_state``,
            ``load_state`` and ``main_process_first`` for the ranks that have not arrived,
            before raising :class:`~accel.errors.ArrivalTimeoutError` naming them (the call
            was made inside ``if accel.is_main_process:``); default 300 (5 minutes), also
            ``ACCEL_ARRIVAL_TIMEOUT`` and the config key. See ``docs/collectives.md``.
        debug: check every collective's shapes on all ranks first (also ``ACCEL_DEBUG=1``).
        seed: seed python, numpy and torch RNGs identically on every rank.
        on_each_node: the default of ``save``, ``save_model``, ``save_state`` and
            ``load_state``: each machine's local main process writes (and reads) its own copy,
            for machines without a shared filesystem (also the config key ``on_each_node``
            and ``ACCEL_ON_EACH_NODE=1``); default False (one copy, written by rank 0).
        dp_replicate_size: data-parallel replicas (HSDP's replicate dimension).
        dp_shard_size: processes each model is sharded over with FSDP (implies
            ``strategy="fsdp"`` when > 1).
        tp_size: tensor-parallel degree (``prepare_model(tp_plan=...)`` splits layers over
            it). With any of the sizes set the block gets a DeviceMesh (``state().mesh``,
            dims ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``); one size left unset
            takes what remains (see ``docs/parallelism.md``).
        cp_size: context-parallel degree: the processes that split each sequence (the
            ``cp`` mesh dim; see ``accel.parallel.context_parallel``). They see the same
            batches and join the FSDP group (``dp_shard`` x ``cp``) or the DDP average.
        cp_method: how attention is split under ``cp_size > 1``: ``"alltoall"`` (attention
            heads exchanged, any device and backend) or ``"ring"`` (torch's ring attention,
            CUDA only); default ``"ring"`` on CUDA, else ``"alltoall"``.
        pp_size: pipeline stages (the mesh's outermost dim): ``prepare_model(pp_plan=...)``
            splits the model over them and ``accel.pipeline_step`` trains it.
        heartbeat_interval: on a job spanning several machines, seconds between each
            process's liveness stamps in the job's store; default 1 (also
            ``ACCEL_HEARTBEAT_INTERVAL``, the config key, ``accel launch --heartbeat-interval``).
        liveness_timeout: seconds a machine may go unheard (or the store unanswered) before
            every other machine ends its processes with a
            :class:`~accel.errors.MachineLostError` naming it; default 10, 0 turns the watch
            off (also ``ACCEL_LIVENESS_TIMEOUT``, the config key, ``accel launch
            --liveness-timeout``). See ``docs/launching.md``, "Many machines".
        **options: DDP and FSDP options, and ``activation_checkpointing`` (also
            ``ACCEL_ACTIVATION_CHECKPOINTING`` and the config key), the default of every
            ``prepare_model`` in the block; under fp8 ``fp8_recipe`` (``"tensorwise"``, the
            default, ``"rowwise"`` or a torchao ``Float8LinearConfig``; also
            ``ACCEL_FP8_RECIPE``, the config key and ``accel launch --fp8_recipe``) and
            ``fp8_module_filter`` (``fn(module, name) -> bool``: the layers to convert).
            Readable as ``accel.state().options``.

    Every rank must enter it: the ranks then agree on what each resolved (mixed precision,
    accumulation, strategy, debug, the mesh sizes, the cp method, the options, whether from
    arguments, ``ACCEL_*`` variables or the config file) with one small collective, and a
    nested block does the same when it sets any of them (``debug``, ``timeout`` or ``seed``
    alone do not; see ``docs/state.md``, "Ranks that disagree").

    Raises:
        ConfigError: an option or launch variable is invalid, or the ranks resolved different
            settings (on every rank, naming each key that differs and each rank's value).

    Example:
        >>> with accel.distributed(mixed_precision="bf16") as st:
        ...     print(st.rank, st.world_size, st.device)
        0 1 cpu
    """
    check_options(options, _NAMED)
    _check_backend_and_cpu(backend, cpu)
    timeout_s = _as_seconds(timeout)
    on_each_node = _check_on_each_node(on_each_node)
    changes: dict[str, Any] = {
        "mixed_precision": mixed_precision,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "strategy": strategy,
        "debug": debug,
        "timeout": timeout_s,
        "arrival_timeout": _as_seconds(arrival_timeout),
    }
    sizes = {"dp_replicate_size": dp_replicate_size, "dp_shard_size": dp_shard_size,
             "cp_size": cp_size, "tp_size": tp_size, "pp_size": pp_size}
    if cp_method is not None:
        _check_cp_method(cp_method, "cp_method")
    if has_active_state():
        if heartbeat_interval is not None or liveness_timeout is not None:
            raise ConfigError(
                "accel.distributed(heartbeat_interval=..., liveness_timeout=...) inside an "
                "active block: the liveness watch belongs to the process group, set up by the "
                "outermost block. Pass them there."
            )
        if cp_method is not None and cp_method != state().cp_method:
            raise ConfigError(
                f"accel.distributed(cp_method={cp_method!r}) inside a block whose cp_method is "
                f"{state().cp_method!r}: it is chosen once, with the mesh, by the outermost "
                "block. Pass it there."
            )
        yield from _nested_block(
            sizes, changes, options, backend=backend, cpu=cpu, seed=seed,
            on_each_node=on_each_node,
        )
        return
    env, file_options = _with_config_file(read_launch_env())
    options = {**file_options, **options}  # distributed(**options) wins over the file
    bounds = liveness_bounds(env, heartbeat_interval=heartbeat_interval,
                             liveness_timeout=liveness_timeout)
    process = _find_process(env, backend, cpu or bool(env.cpu))
    if cp_method is not None:
        env = attrs.evolve(env, cp_method=cp_method)
    current, created = _start(
        env, process, sizes, changes, seed=seed, on_each_node=on_each_node, options=options
    )
    yield from _run_block(current, created, seed, (bounds, env))


def _nested_block(
    sizes: Mapping[str, int | None], changes: dict[str, Any], options: dict[str, Any], *,
    backend: str | None, cpu: bool, seed: int | None, on_each_node: bool | None,
) -> Iterator[ProcessState]:
    """A block inside an active one: the same group and mesh, the changed options scoped."""
    _same_mesh(state(), sizes)
    fixed = {"backend": backend, "cpu": cpu or None}
    inner = _nested(
        state(), fixed=fixed, changes=changes, options=options, on_each_node=on_each_node
    )
    if seed is not None:  # recorded in the block's state, as for an outer block
        inner = attrs.evolve(inner, seed=seed)
    if _changes_agreed(changes, options, on_each_node):
        agree_on_settings(
            "accel.distributed()", settings_of(inner), device=inner.device, st=inner
        )
    with set_state(inner):
        if seed is not None:
            set_seed(seed)
        yield inner


def _changes_agreed(
    changes: Mapping[str, Any], options: Mapping[str, Any], on_each_node: bool | None
) -> bool:
    """Whether a nested block sets a run-wide setting the ranks must agree on (and is then
    a collective): ``debug``, ``timeout`` and ``seed`` alone scope this rank only."""
    agreed = ("mixed_precision", "gradient_accumulation_steps", "strategy")
    return bool(options) or on_each_node is not None or any(
        changes[key] is not None for key in agreed
    )


def _find_process(env: LaunchEnv, backend: str | None, use_cpu: bool) -> Place:
    """This process's place (:func:`~accel.core.state.find_place`), with the backend of the
    group to create when the launcher started several processes and none exists yet."""
    place = find_place(env, cpu=use_cpu)
    if place.backend is not None or env.world_size <= 1:
        return place
    if not dist.is_available():
        raise ConfigError(
            f"The launcher started {env.world_size} processes but this torch build has no "
            "torch.distributed. Install a torch build with distributed support."
        )
    return attrs.evolve(place, backend=_pick_backend(backend or env.backend, place.device))


def _start(
    env: LaunchEnv, process: Place, sizes: Mapping[str, int | None],
    changes: dict[str, Any], *, seed: int | None, on_each_node: bool | None,
    options: dict[str, Any],
) -> tuple[ProcessState, bool]:
    """The block's state: its mesh and policy resolved, the device set, the group created
    when none exists (and whether it was)."""
    world, device = process.world_size, process.device
    shape = mesh_shape(
        world, changes["strategy"] if changes["strategy"] is not None else env.strategy,
        {k: v if v is not None else getattr(env, k) for k, v in sizes.items()},
        device_type=device.type,
    )
    if shape is not None and shape.dp_shard > 1 and changes["strategy"] is None:
        changes = {**changes, "strategy": SHARDING_ENGINE}
    method = _cp_method(env.cp_method, device) if shape is not None and shape.cp > 1 else None
    strategy = changes["strategy"] if changes["strategy"] is not None else env.strategy
    facts = ENGINE_FACTS.get(str(strategy).lower())
    if facts is not None and facts.policy_option is not None:
        # the engine's own config speaks where nothing else did (DeepSpeed's JSON)
        given = {"mixed_precision": env.mixed_precision,
                 "gradient_accumulation_steps": env.gradient_accumulation_steps}
        said = deepspeed_policy(options.get(facts.policy_option))
        changes = {**changes, **{key: value for key, value in said.items()
                                 if changes[key] is None and given[key] is None}}
    policy = resolve_policy(env, world_size=world, **changes)
    policy = keep_global_batch(policy, options, world_size=world, rank=process.rank)
    _require_package(policy["strategy"], ENGINE_FACTS[policy["strategy"]])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = False
    if process.backend is not None and not dist.is_initialized():
        _init_group(env, process.backend, policy["timeout"])
        created = True
    launched = world == env.world_size
    current = ProcessState(
        rank=process.rank,
        local_rank=process.local_rank,
        world_size=world,
        local_world_size=process.local_world_size,
        node_rank=env.node_rank if launched else process.rank // max(1, process.local_world_size),
        num_nodes=env.num_nodes if launched else 1,
        device=device,
        backend=process.backend,
        seed=seed,
        on_each_node=bool(env.on_each_node) if on_each_node is None else on_each_node,
        options=options,
        mesh_shape=None if shape is None else shape.sizes(),
        cp_method=method,
        **policy,
    )
    try:  # before the mesh: ranks with different sizes would make different subgroups
        agree_on_settings(
            "accel.distributed()", settings_of(current), device=device, st=current
        )
    except (ConfigError, CollectiveTimeoutError, CollectiveMismatchError):
        if created:
            _leave_after_error()  # no collective: every rank raises alike
        raise
    if shape is not None and world > 1:
        current = attrs.evolve(current, mesh=build_mesh(device.type, shape))
    return current, created


def _require_package(strategy: str, facts: EngineFacts) -> None:
    """Refuse an engine at once when the package it needs is not installed (nothing is
    imported here: the engine's unit imports it when the model is prepared)."""
    if facts.package is not None and importlib.util.find_spec(facts.package) is None:
        raise ConfigError(
            f"strategy={strategy!r} needs {facts.package}, which is not installed. Install the "
            f"extra: `pip install 'accel[{facts.extra or facts.package}]'`, or choose another "
            "strategy, e.g. `accel.distributed(strategy='fsdp')`."
        )


def _check_cp_method(method: object, where: str) -> CpMethod:
    if method not in CP_METHODS:
        raise ConfigError(
            f"{where}={method!r} is not a context parallel method; choose one of "
            f"{list(CP_METHODS)}, e.g. `accel.distributed(cp_size=2, cp_method='alltoall')`."
        )
    return method  # type: ignore[return-value]


def _cp_method(given: str | None, device: torch.device) -> CpMethod:
    """The context parallel method: the one given, else ring on CUDA and alltoall elsewhere.

    Raises:
        ConfigError: an unknown method, or ``"ring"`` off CUDA.
    """
    if given is None:
        return "ring" if device.type == "cuda" else "alltoall"
    method = _check_cp_method(given, "cp_method")
    if method == "ring" and device.type != "cuda":
        raise ConfigError(
            f"cp_method='ring' on {device.type!r}: torch's ring attention (`context_parallel`) "
            "needs CUDA attention kernels (flash / memory-efficient SDPA), which this device "
            "lacks. Use `cp_method='alltoall'` (attention heads exchanged, runs anywhere, "
            "gloo included), or run on CUDA."
        )
    return method


def _run_block(
    current: ProcessState, created: bool, seed: int | None,
    liveness: tuple[LivenessBounds, LaunchEnv] | None = None,
) -> Iterator[ProcessState]:
    """Yield ``current`` as the block's state; leave the group this block created (and stop
    its liveness watch, :mod:`accel.core.liveness`, once every rank reached the end)."""
    watch: Watch | None = None
    try:
        record = Scope(created_group=created)
        if created and liveness is not None:
            bounds, env = liveness
            watch = start_watch(current, bounds, store_host=env.master_addr or "127.0.0.1",
                                store_port=env.master_port or DEFAULT_PORT)
        with set_state(current, record):
            try:
                if seed is not None:
                    set_seed(seed)
                yield current
            except BaseException:
                run_exit_steps(record, failed=True)
                raise
            run_exit_steps(record, failed=False)  # e.g. async saves finished, DDP released
    except BaseException as error:
        lost = None
        if watch is not None:
            watch.stop(clean=False)
            lost = watch.explain(error)  # gloo's "[addr]:port ... reset" as the machine
        if created and dist.is_initialized():
            _leave_after_error()
        if lost is not None:
            raise lost from error
        raise
    if created and dist.is_initialized():
        _teardown(watch)
    elif watch is not None:
        watch.stop(clean=True)


_NAMED = (
    "backend", "mixed_precision", "gradient_accumulation_steps", "strategy", "cpu", "timeout",
    "arrival_timeout", "debug", "seed", "on_each_node", "dp_replicate_size", "dp_shard_size",
    "tp_size", "cp_size", "pp_size", "cp_method", "heartbeat_interval", "liveness_timeout",
)


def _same_mesh(outer: ProcessState, sizes: Mapping[str, int | None]) -> None:
    """Refuse mesh sizes in a nested block that differ from the outer block's mesh."""
    shape = outer.mesh_shape
    have = dict.fromkeys(SIZE_KEYS) if shape is None else dict(
        zip(SIZE_KEYS, shape, strict=True)
    )
    for key, value in sizes.items():
        if value is not None and value != have[key]:
            raise ConfigError(
                f"accel.distributed({key}={value}) inside a block whose mesh is "
                f"{outer.mesh_shape or 'not set'} (pp, dp_replicate, dp_shard, cp, tp): the mesh "
                "is made once, by the outermost block. Pass the sizes there."
            )


def _with_config_file(env: LaunchEnv) -> tuple[LaunchEnv, dict[str, Any]]:
    """Fill the options the environment leaves unset from the config file (env wins).

    Also returns the file's DDP options (``find_unused_parameters``, ``comm_hook``...) and
    model options (``activation_checkpointing``, where ``ACCEL_<KEY>`` wins over the file),
    which join ``accel.state().options`` under those passed to ``distributed()``.
    """
    config = load_config(env.config_file)
    missing: dict[str, Any] = {
        key: config[key]
        for key in POLICY_KEYS
        if key in config and getattr(env, key) is None
    }
    file_options = {key: config[key] for key in (*DDP_CONFIG_KEYS, *MODEL_KEYS) if key in config}
    for key in MODEL_KEYS:
        variable = env_variable(key)
        raw = read_variable(variable)
        if raw is not None:
            file_options[key] = validate_setting(key, raw, variable, variable=variable)
    return (attrs.evolve(env, **missing) if missing else env), file_options


def _teardown(watch: Watch | None = None) -> None:
    """Destroy the group this block created, once every rank has reached the end.

    Without the barrier a rank that finishes first closes its connections while a peer's
    last collective is still completing in gloo's background threads, which can abort the
    peer at exit ("terminate called without an active exception"). The barrier's work is kept
    to the interpreter's end (:func:`accel.core.exit_refs.final_barrier`): its late release by
    a worker thread during finalization aborted the process the same way.
    """
    final_barrier()
    if watch is not None:  # only now: a rank still in the block is watched to its end
        watch.stop(clean=True)
    dist.destroy_process_group()


def _leave_after_error() -> None:
    """Leave the group this block created while an exception propagates: no collective.

    A barrier here would wait forever for peers that are still training (or blocked in a
    collective this rank will never join), so the process would never exit and the launcher
    would never learn that it failed. Instead the group is torn down locally (the block's exit
    steps already ran, e.g. DDP reducers released): it is aborted (NCCL: no wait for in-flight
    kernels) or destroyed (gloo: closes the connections, so a peer blocked in a collective gets
    an error at once). Nothing here may raise over the user's exception.
    """
    try:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if dist.get_backend() == "nccl" and abort is not None:
            abort()  # destroying would wait for this rank's kernels stuck on a dead peer
        else:
            dist.destroy_process_group()
    except Exception:  # a broken group cannot be left more cleanly
        pass

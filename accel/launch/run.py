"""``accel launch``: run a script on N processes through torch's elastic launcher (torchrun).

The work is split in two: :func:`plan_launch` is a pure function from the options, the
environment and the config file to torchrun's argument list and the variables the workers get;
:func:`run_plan` hands that to ``torch.distributed.run`` and turns a failure into a readable
report (failing rank, exit code or signal, its traceback) and a non-zero exit code.

Writing the environment is this module's job: the workers inherit the launcher's environment,
so the ``ACCEL_*`` options and ``OMP_NUM_THREADS`` are set in this (launcher) process only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from accel.core.config_file import config_path, load_config
from accel.core.env import LaunchEnv, read_launch_env, read_variable
from accel.core.setting_values import allowed
from accel.core.settings import (
    DEEPSPEED_KEYS,
    DEFAULT_CPU_PROCESSES,
    DEFAULT_PORT,
    ENV_PREFIX,
    MIXED_PRECISION_MODES,
    MODEL_KEYS,
    POLICY_KEYS,
    PRECISION_KEYS,
    SETTINGS,
    STRATEGIES,
    cpu_count,
    env_variable,
)
from accel.errors import ConfigError
from accel.launch.config import Resolved, resolve_settings
from accel.launch.failures import describe_failure, is_peer_loss
from accel.launch.rendezvous import describe_rendezvous_failure, rendezvous_conf

__all__ = [
    "LaunchPlan",
    "add_launch_options",
    "command_line_settings",
    "describe_failure",
    "is_peer_loss",
    "launch",
    "plan_launch",
    "run_plan",
]

WORKER_MODULE = "accel.launch.worker"
CPU_DEFAULT_PROCESSES = DEFAULT_CPU_PROCESSES
DEFAULT_STOP_GRACE_S = 60.0

def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """Add the launch options (torchrun's and Accelerate's spellings) to ``parser``.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_launch_options(parser)
        >>> parser.parse_args(["--num_processes", "4"]).num_processes
        4
    """
    where = parser.add_argument_group("processes and machines")
    where.add_argument("--nproc-per-node", "--nproc_per_node", type=int, metavar="N",
                       help="processes on this machine (default: one per GPU, else 2)")
    where.add_argument("--num-processes", "--num_processes", type=int, metavar="N",
                       help="processes in total, across all machines (Accelerate's spelling)")
    where.add_argument("--nnodes", "--num-machines", "--num_machines", metavar="M",
                       help="machines in the job, or MIN:MAX for an elastic job (default 1)")
    where.add_argument("--node-rank", "--node_rank", "--machine-rank", "--machine_rank",
                       type=int, metavar="R", help="rank of this machine (default 0)")
    where.add_argument("--master-addr", "--master_addr", "--main-process-ip",
                       "--main_process_ip", metavar="A", help="address of machine 0")
    where.add_argument("--master-port", "--master_port", "--main-process-port",
                       "--main_process_port", type=int, metavar="P",
                       help="port on machine 0 (default: a free port on one machine, else "
                            f"{DEFAULT_PORT})")
    where.add_argument("--rdzv-backend", "--rdzv_backend", metavar="B",
                       help="torchrun rendezvous backend (e.g. c10d) for elastic jobs")
    where.add_argument("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT",
                       help="torchrun rendezvous endpoint")
    where.add_argument("--rdzv-id", "--rdzv_id", metavar="ID", help="torchrun job id")
    where.add_argument("--rdzv-conf", "--rdzv_conf", metavar="K=V,...",
                       help="torchrun rendezvous options")
    where.add_argument("--standalone", action="store_true", default=None,
                       help="one machine, free port (the default on one machine)")
    where.add_argument("--max-restarts", "--max_restarts", type=int, metavar="K",
                       help="restart the whole job up to K times when a process fails")
    where.add_argument("--monitor-interval", "--monitor_interval", type=float, metavar="S",
                       help="seconds between checks of the workers (torchrun's default)")
    where.add_argument("--stop-grace-period", "--stop_grace_period", type=float, metavar="S",
                       help="on SIGTERM/SIGINT/SIGUSR1, the seconds the workers get to stop "
                            "(the signal is passed on to them) before they are killed "
                            f"(default {DEFAULT_STOP_GRACE_S:g})")
    where.add_argument("--log-dir", "--log_dir", metavar="DIR", help="torchrun log directory")
    where.add_argument("-r", "--redirects", metavar="SPEC", help="torchrun --redirects")
    where.add_argument("-t", "--tee", metavar="SPEC", help="torchrun --tee")
    where.add_argument("--local-ranks-filter", "--local_ranks_filter", metavar="RANKS",
                       help="show the output of these local ranks only")
    where.add_argument("--use-parallelism-config", "--use_parallelism_config",
                       action="store_true",
                       help="accepted for Accelerate compatibility (implied by the mesh sizes)")
    where.add_argument("--multi-gpu", "--multi_gpu", action="store_true",
                       help="accepted for Accelerate compatibility (implied)")
    policy = parser.add_argument_group("training options (reach accel.distributed())")
    policy.add_argument("--mixed-precision", "--mixed_precision", metavar="MODE",
                        help=f"{', '.join(MIXED_PRECISION_MODES)} (fp8: torchao, accel[fp8])")
    for key in PRECISION_KEYS:  # each precision mode's settings, as the table declares them
        spec = SETTINGS[key]
        values = ", ".join(spec.choices) if spec.choices else allowed(spec)
        default = "" if spec.default is None else f"; default {spec.default}"
        policy.add_argument(f"--{key.replace('_', '-')}", f"--{key}",
                            metavar=key.rsplit("_", 1)[-1][0].upper(),  # fp8_recipe: R
                            help=f"{values} (mixed precision {spec.mode}{default})")
    policy.add_argument("--gradient-accumulation-steps", "--gradient_accumulation_steps",
                        type=int, metavar="K", help="batches per optimizer step")
    policy.add_argument("--keep-global-batch", "--keep_global_batch", metavar="max|N",
                        help="elastic jobs: --gradient-accumulation-steps and the per-rank "
                             "batch are for N processes (max: the most the launch allows, "
                             "MAX machines x nproc-per-node); a restart on another world size "
                             "scales the accumulation steps to keep the global batch")
    policy.add_argument("--strategy", metavar="S", help=", ".join(STRATEGIES))
    policy.add_argument("--use-fsdp", "--use_fsdp", action="store_true",
                        help="same as --strategy fsdp (Accelerate's spelling)")
    policy.add_argument("--backend", metavar="B", help="gloo, nccl, ... (default: by device)")
    deepspeed = parser.add_argument_group("DeepSpeed (strategy deepspeed; see docs/deepspeed.md)")
    deepspeed.add_argument("--use-deepspeed", "--use_deepspeed", action="store_true",
                           help="same as --strategy deepspeed (Accelerate's spelling)")
    deepspeed.add_argument("--deepspeed-config-file", "--deepspeed_config_file",
                           dest="deepspeed_config", metavar="F",
                           help="the DeepSpeed JSON config (its \"auto\" values filled by accel)")
    deepspeed.add_argument("--zero-stage", "--zero_stage", type=int, metavar="N",
                           help="ZeRO stage 0-3")
    deepspeed.add_argument("--offload-optimizer-device", "--offload_optimizer_device",
                           dest="offload_optimizer", metavar="D",
                           help="none, cpu or nvme: where ZeRO keeps optimizer states")
    deepspeed.add_argument("--offload-param-device", "--offload_param_device",
                           dest="offload_params", metavar="D",
                           help="none, cpu or nvme: where ZeRO-3 keeps parameters")
    deepspeed.add_argument("--gradient-clipping", "--gradient_clipping", type=float,
                           metavar="X", help="the gradient norm clip of the config's \"auto\"")
    policy.add_argument("--cpu", action="store_true", default=None,
                        help="run on the CPU even where GPUs are available")
    policy.add_argument("--debug", action="store_true", default=None,
                        help="check every collective across ranks first")
    policy.add_argument("--timeout", type=float, metavar="S",
                        help="seconds before a collective gives up")
    policy.add_argument("--arrival-timeout", "--arrival_timeout", type=float, metavar="S",
                        help="seconds a rank waits at save_state/load_state for ranks that "
                             "never come (a call inside `if is_main_process:`); default 300")
    policy.add_argument("--heartbeat-interval", "--heartbeat_interval", type=float, metavar="S",
                        help="several machines: seconds between each process's liveness "
                             "stamps; default 1")
    policy.add_argument("--liveness-timeout", "--liveness_timeout", type=float, metavar="S",
                        help="several machines: seconds a machine may go unheard before the "
                             "others end the job naming it; default 10, 0: no watch")
    where.add_argument("--rendezvous-timeout", "--rendezvous_timeout", type=float, metavar="S",
                       help="seconds to wait at start-up for every machine before naming those "
                            "that never arrived (default 600)")
    mesh = parser.add_argument_group("device mesh (reach accel.distributed(); see "
                                     "docs/parallelism.md)")
    for size, what in (("dp_replicate", "data-parallel replicas (HSDP's replicate dim)"),
                       ("dp_shard", "processes each model is sharded over (FSDP)"),
                       ("tp", "tensor-parallel degree"),
                       ("cp", "context-parallel degree (processes that split each sequence)"),
                       ("pp", "pipeline-parallel stages")):
        accelerate = () if size == "pp" else (f"--parallelism_config_{size}_size",)
        mesh.add_argument(f"--{size.replace('_', '-')}-size", f"--{size}_size", *accelerate,
                          dest=f"{size}_size", type=int, metavar="N", help=what)
    mesh.add_argument("--cp-method", "--cp_method", dest="cp_method", metavar="M",
                      help="context parallel attention: alltoall (any device) or ring (CUDA); "
                           "default ring on CUDA, else alltoall")
    policy.add_argument("--config-file", "--config_file", metavar="F",
                        help="config file (default: $ACCEL_CONFIG_FILE, else "
                             "~/.config/accel/config.toml)")


def command_line_settings(ns: argparse.Namespace) -> dict[str, object]:
    """The settings given on the command line, under their config-file names.

    Example:
        >>> ns = argparse.Namespace(mixed_precision="bf16", use_fsdp=True)
        >>> command_line_settings(ns)["strategy"]
        'fsdp'
    """
    get = vars(ns).get
    machines = get("nnodes")
    keep = get("keep_global_batch")
    if keep is not None and keep != "max" and not str(keep).strip().isdigit():
        raise ConfigError(
            f"--keep-global-batch={keep!r} is invalid; give `max` (the most processes the "
            "launch allows: MAX machines x nproc-per-node) or a world size, e.g. "
            "`--keep-global-batch max` or `--keep-global-batch 4`."
        )
    strategy = get("strategy") or (
        "fsdp" if get("use_fsdp") else "deepspeed" if get("use_deepspeed") else None
    )
    out: dict[str, object] = {
        "num_machines": None if machines is None or ":" in str(machines) else machines,
        "num_processes": get("num_processes"),
        "machine_rank": get("node_rank"),
        "main_process_ip": get("master_addr"),
        "main_process_port": get("master_port"),
        "max_restarts": get("max_restarts"),
        "mixed_precision": get("mixed_precision"),
        **{key: get(key) for key in PRECISION_KEYS},
        "gradient_accumulation_steps": get("gradient_accumulation_steps"),
        "keep_global_batch": None if get("keep_global_batch") == "max" else get(
            "keep_global_batch"
        ),
        "strategy": strategy,
        "backend": get("backend"),
        "cpu": get("cpu"),
        "debug": get("debug"),
        "timeout": get("timeout"),
        "arrival_timeout": get("arrival_timeout"),
        "heartbeat_interval": get("heartbeat_interval"),
        "liveness_timeout": get("liveness_timeout"),
        "rendezvous_timeout": get("rendezvous_timeout"),
        **{key: get(key) for key in ("dp_replicate_size", "dp_shard_size", "tp_size",
                                     "cp_size", "pp_size", "cp_method")},
        **{key: get(key) for key in DEEPSPEED_KEYS},
    }
    return {key: value for key, value in out.items() if value is not None}


@attrs.frozen(kw_only=True)
class LaunchPlan:
    """What ``accel launch`` will run: torchrun's arguments and the workers' variables."""

    torchrun_args: tuple[str, ...]
    worker_env: Mapping[str, str]
    settings: Mapping[str, Resolved]
    nproc_per_node: int
    nnodes: str


def _machines(raw: str) -> tuple[str, int]:
    """``"2"`` -> (``"2"``, 2); ``"1:4"`` -> (``"1:4"``, 4) (the most a job can have)."""
    parts = raw.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2) or min(numbers) < 1 or numbers[0] > numbers[-1]:
        raise ConfigError(
            f"--nnodes={raw!r} is invalid; give a number of machines >= 1 or MIN:MAX, "
            "e.g. `--nnodes 2` or `--nnodes 1:4`."
        )
    return raw, numbers[-1]


def _env_text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def plan_launch(
    ns: argparse.Namespace,
    *,
    env: LaunchEnv,
    file_settings: Mapping[str, object],
    config_file: Path | None,
    gpu_count: Callable[[], int],
    cpu_count: int,
    omp_num_threads_set: bool,
) -> LaunchPlan:
    """Turn the options, the environment and the config file into a :class:`LaunchPlan`.

    Pure: reads nothing itself. ``ns`` holds the options of :func:`add_launch_options` plus
    ``script``, ``script_args``, ``module`` and ``no_python``.

    Raises:
        ConfigError: contradictory or invalid options.

    Example:
        >>> plan = plan_launch(ns, env=LaunchEnv(), file_settings={}, config_file=None,
        ...                    gpu_count=lambda: 0, cpu_count=8, omp_num_threads_set=False)
        >>> plan.nproc_per_node, plan.worker_env["OMP_NUM_THREADS"]
        (2, '4')
    """
    settings = resolve_settings(command_line_settings(ns), env, file_settings)
    value = {key: resolved.value for key, resolved in settings.items()}
    nnodes, machines = _machines(str(ns.nnodes or value["num_machines"]))
    nproc, cpu = _processes_per_machine(ns, settings, machines, gpu_count)
    args: list[str] = ["--nnodes", nnodes, "--nproc-per-node", str(nproc),
                       "--max-restarts", str(value["max_restarts"])]
    if ns.monitor_interval is not None:
        args += ["--monitor-interval", str(ns.monitor_interval)]
    args += _stop_args(getattr(ns, "stop_grace_period", None))
    rendezvous, dynamic = _rendezvous_args(ns, value, nnodes, machines)
    if machines > 1 or ":" in nnodes:  # the start-up bound (accel.launch.rendezvous)
        ns = argparse.Namespace(**{**vars(ns), "rdzv_conf": rendezvous_conf(
            ns.rdzv_conf, float(str(value["rendezvous_timeout"])), dynamic=dynamic)})
    args += rendezvous + _program_args(ns)
    worker_env = _worker_env(settings, cpu=cpu, config_file=config_file, dynamic=dynamic)
    if getattr(ns, "keep_global_batch", None) == "max":  # the largest world the launch allows
        worker_env[env_variable("keep_global_batch")] = str(machines * nproc)
    if not omp_num_threads_set:
        worker_env["OMP_NUM_THREADS"] = str(max(1, cpu_count // nproc))
    return LaunchPlan(torchrun_args=tuple(args), worker_env=worker_env, settings=settings,
                      nproc_per_node=nproc, nnodes=nnodes)


def _processes_per_machine(
    ns: argparse.Namespace, settings: Mapping[str, Resolved], machines: int,
    gpu_count: Callable[[], int],
) -> tuple[int, bool]:
    """Processes per machine (the flag, the total over the machines, or one per GPU), and
    whether they run on the CPU."""
    cpu = bool(settings["cpu"].value)
    if ns.nproc_per_node is not None:
        if ns.nproc_per_node < 1:
            raise ConfigError(
                f"--nproc-per-node={ns.nproc_per_node!r} must be >= 1, e.g. `--nproc-per-node 2`."
            )
        return ns.nproc_per_node, cpu
    if settings["num_processes"].value is not None:
        total = int(str(settings["num_processes"].value))
        if total % machines:
            source = settings["num_processes"].source
            raise ConfigError(
                f"num_processes={total!r} (in total, from the {source}) is not a multiple of "
                f"the {machines} machines. Give `--nproc-per-node N` (per machine) instead."
            )
        return total // machines, cpu
    gpus = 0 if cpu else gpu_count()
    return (gpus if gpus > 0 else CPU_DEFAULT_PROCESSES), cpu or gpus == 0


def _rendezvous_args(
    ns: argparse.Namespace, value: Mapping[str, object], nnodes: str, machines: int
) -> tuple[list[str], bool]:
    """torchrun's rendezvous options, and whether the rendezvous is dynamic (c10d: its
    store is shared with the workers by default)."""
    port = value["main_process_port"]
    if ns.rdzv_endpoint:
        args = ["--rdzv-backend", ns.rdzv_backend or "c10d", "--rdzv-endpoint", ns.rdzv_endpoint]
        if ns.rdzv_id:
            args += ["--rdzv-id", ns.rdzv_id]
        return args, True
    if ns.standalone or (nnodes == "1" and port is None and not ns.rdzv_backend):
        if machines > 1:
            raise ConfigError(
                f"--standalone runs on one machine, but {machines} machines were asked for. "
                "Drop `--standalone` or use `--nnodes 1`."
            )
        return ["--standalone"], True  # c10d rendezvous on localhost:0: the OS picks a port
    addr = value["main_process_ip"]
    if addr is None:
        if machines > 1:
            raise ConfigError(
                f"A job on {nnodes} machines needs the address of machine 0; give "
                "`--master-addr <ip of machine 0>` (or `main_process_ip` in the config)."
            )
        addr = "127.0.0.1"
    if ns.rdzv_backend and ns.rdzv_backend != "static":
        raise ConfigError(
            f"--rdzv-backend={ns.rdzv_backend!r} needs `--rdzv-endpoint HOST:PORT`; or "
            "drop it to use --master-addr/--master-port."
        )
    args = ["--node-rank", str(value["machine_rank"]), "--master-addr", str(addr),
            "--master-port", str(port if port is not None else DEFAULT_PORT)]
    return args, ns.rdzv_backend not in (None, "static")


def _program_args(ns: argparse.Namespace) -> list[str]:
    """torchrun's pass-through options, then what each worker runs."""
    args: list[str] = []
    for flag, given in (("--rdzv-conf", ns.rdzv_conf), ("--log-dir", ns.log_dir),
                        ("--redirects", ns.redirects), ("--tee", ns.tee),
                        ("--local-ranks-filter", ns.local_ranks_filter)):
        if given is not None:
            args += [flag, str(given)]
    if ns.no_python:
        if ns.module:
            raise ConfigError("Use either `--no-python` or `-m/--module`, not both.")
        return [*args, "--no-python", ns.script, *ns.script_args]
    target = ["-m", ns.script] if ns.module else [ns.script]
    return [*args, "--module", WORKER_MODULE, *target, *ns.script_args]


def _worker_env(
    settings: Mapping[str, Resolved], *, cpu: bool, config_file: Path | None, dynamic: bool
) -> dict[str, str]:
    """The variables the workers get: the settings accel.distributed() reads, and torch's."""
    worker_env: dict[str, str] = {}
    for key in POLICY_KEYS:
        if settings[key].source != "default":
            worker_env[env_variable(key)] = _env_text(settings[key].value)
    for key in MODEL_KEYS:  # the file's and the environment's reach the workers as they are
        if settings[key].source == "command line":
            worker_env[env_variable(key)] = _env_text(settings[key].value)
    if cpu:
        worker_env[env_variable("cpu")] = "1"
    if config_file is not None:
        worker_env[ENV_PREFIX + "CONFIG_FILE"] = str(config_file.resolve())
    if dynamic and int(str(settings["max_restarts"].value)) > 0:
        # torch reuses the rendezvous store across restarts without a per-attempt prefix, so
        # restarted workers read the dead workers' addresses and cannot connect; a fresh store
        # per attempt avoids it.
        worker_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return worker_env


def _stop_args(grace: float | None) -> list[str]:
    """torch's agent passes these signals on to the workers and kills them ``grace`` s later."""
    from accel.launch.graceful import FORWARDED_SIGNALS

    grace = DEFAULT_STOP_GRACE_S if grace is None else grace
    if not grace >= 0 or grace == float("inf"):
        raise ConfigError(
            f"--stop-grace-period={grace!r} must be a number of seconds >= 0, e.g. "
            "`--stop-grace-period 120`."
        )
    return ["--signals-to-handle", ",".join(FORWARDED_SIGNALS),
            "--shutdown-timeout", str(math.ceil(grace))]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_plan(ns: argparse.Namespace) -> LaunchPlan:
    """Read the environment and the config file, then :func:`plan_launch`.

    Example:
        >>> make_plan(parser.parse_args(["train.py"])).nproc_per_node
        2
    """
    env = read_launch_env()
    path, how = config_path(ns.config_file, env=env)
    file_settings = load_config(path if how != "user config dir" else None)
    exists = path.is_file()
    return plan_launch(
        ns,
        env=env,
        file_settings=file_settings,
        config_file=path if exists else None,
        gpu_count=_gpu_count,
        cpu_count=cpu_count(),
        # whether the user chose a thread count for the workers
        omp_num_threads_set=read_variable("OMP_NUM_THREADS") is not None,
    )


def run_plan(plan: LaunchPlan, what: str) -> int:
    """Run the plan with ``torch.distributed.run``; return the launcher's exit code.

    Sets the plan's worker variables in this process's environment (the workers inherit it).

    Example:
        >>> sys.exit(run_plan(make_plan(ns), "train.py"))
    """
    os.environ.update(plan.worker_env)
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from accel.launch.graceful import recording_worker_exits, stop_outcome, supported_stop_args
    from accel.launch.oom import oom_evidence, read_oom_kills

    args, grace, note = supported_stop_args(plan.torchrun_args)
    if plan.worker_env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        from accel.launch.free_port import use_wildcard_free_port

        use_wildcard_free_port()  # torch's probe binds localhost, absent on some machines
    sys.stderr.write(note)
    exits: dict[int, int | None] = {}
    oom_kills = read_oom_kills()  # a SIGKILL is called out of memory only if these rise
    try:
        parsed = torchrun.parse_args(args)  # type: ignore[no-untyped-call]
        with recording_worker_exits() as exits:
            torchrun.run(parsed)  # type: ignore[no-untyped-call]
    except ChildFailedError as error:
        oom = oom_evidence(oom_kills, read_oom_kills())
        text, code = describe_failure(error, what, oom=oom)
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
        return code
    except RuntimeError as error:  # torch's store errors: a start-up that timed out
        report = describe_rendezvous_failure(error, args)
        if report is None:
            raise
        sys.stdout.flush()
        sys.stderr.write(report)
        sys.stderr.flush()
        return 1
    except SignalException as error:  # the workers got the signal too, and a grace period
        text, code = stop_outcome(error.sigval, exits, grace)
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
        return code
    return 0


def launch(ns: argparse.Namespace) -> int:
    """``accel launch``: plan and run (or with ``--dry-run`` print the plan as JSON).

    Example:
        >>> launch(parser.parse_args(["--nproc-per-node", "2", "train.py"]))
        0
    """
    plan = make_plan(ns)
    if getattr(ns, "dry_run", False):
        shown: dict[str, Any] = {
            "torchrun_args": list(plan.torchrun_args),
            "worker_env": dict(plan.worker_env),
            "nproc_per_node": plan.nproc_per_node,
            "nnodes": plan.nnodes,
        }
        print(json.dumps(shown, indent=2))
        return 0
    return run_plan(plan, Path(ns.script).name if not ns.module else ns.script)

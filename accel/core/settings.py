"""Every setting accel reads, defined once: names, kinds, choices, defaults and spellings.

The environment (:mod:`accel.core.env`), ``accel.distributed()``, the config file
(:mod:`accel.core.config_file`), ``accel launch``, ``accel config`` and the notebook launcher all
take their keys, choices, defaults and boolean spellings from here, and check a value against
them with :mod:`accel.core.setting_values`, so a value means the same wherever it is given.
This module imports nothing from accel.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from typing import Literal, get_args

import attrs

__all__ = [
    "BACKENDS",
    "CODE_VALUES",
    "CodeValue",
    "CpMethod",
    "COMM_HOOKS",
    "COMM_WRAPPERS",
    "CP_METHODS",
    "DDP_CONFIG_KEYS",
    "DDP_HOOK_KEYS",
    "DDP_KEYWORDS",
    "FSDP_KEYS",
    "DEEPSPEED_KEYS",
    "DEFAULT_ARRIVAL_TIMEOUT_S",
    "DEFAULT_CPU_PROCESSES",
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "DEFAULT_PORT",
    "DEFAULT_RENDEZVOUS_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "ENV_PREFIX",
    "FALSE_WORDS",
    "FP8_RECIPES",
    "MIXED_PRECISION_MODES",
    "MODEL_KEYS",
    "OFFLOAD_DEVICES",
    "POLICY_KEYS",
    "POWER_SGD_OPTIONS",
    "PRECISION_CODE_KEYS",
    "PRECISION_CODE_OPTIONS",
    "PRECISION_KEYS",
    "SETTINGS",
    "STRATEGIES",
    "TRUE_WORDS",
    "MixedPrecision",
    "Spec",
    "Strategy",
    "cpu_count",
    "did_you_mean",
    "env_variable",
    "parse_bool",
]

MixedPrecision = Literal["no", "fp16", "bf16", "fp8"]
Strategy = Literal["none", "ddp", "fsdp", "deepspeed"]
CpMethod = Literal["alltoall", "ring"]
CP_METHODS: tuple[str, ...] = get_args(CpMethod)
"""How attention is split under context parallelism: heads all-to-all, or torch's ring."""
MIXED_PRECISION_MODES: tuple[str, ...] = get_args(MixedPrecision)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
"""The built-in engines (``strategy=``); ``accel.core.engine_facts.ENGINE_FACTS`` also holds
registered ones."""


BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "hccl")
"""The ``torch.distributed`` backends ``backend=`` accepts."""

FP8_RECIPES = ("tensorwise", "rowwise")
"""The torchao float8 recipes ``fp8_recipe`` names (a torchao ``Float8LinearConfig`` object is
accepted from code too); ``accel.precision.fp8`` turns them into torchao configs."""

DEFAULT_PORT = 29500
"""The rendezvous port when none is given and none can be chosen or derived."""
DEFAULT_TIMEOUT_S = 1800.0
"""Seconds before a collective gives up, unless ``timeout`` says otherwise."""
DEFAULT_ARRIVAL_TIMEOUT_S = 300.0
"""Seconds a rank waits at ``save_state``/``load_state`` (and the other calls every rank must
make that are not per-step) for the ranks that have not arrived before it names them, unless
``arrival_timeout`` says otherwise: far above the usual skew between ranks reaching the same
call, far below the collective ``timeout``."""
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
"""Seconds between two liveness stamps of a process on a job of several machines, unless
``heartbeat_interval`` says otherwise (``accel.core.liveness``)."""
DEFAULT_LIVENESS_TIMEOUT_S = 10.0
"""Seconds a machine may go unheard (none of its processes stamping, or the job's store not
answering) before the others declare it lost, unless ``liveness_timeout`` says otherwise (0:
no watch): far above a stamp's interval, far below the collective ``timeout``."""
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
"""Seconds ``accel launch`` waits at start-up for every machine to arrive before naming those
that did not, unless ``rendezvous_timeout`` says otherwise (torch's static rendezvous' own)."""
DEFAULT_CPU_PROCESSES = 2
"""Processes per machine that the launchers start when there is no GPU and no count given."""
ENV_PREFIX = "ACCEL_"
"""Prefix of the variables through which ``accel launch`` passes settings to the workers."""

TRUE_WORDS = ("1", "true", "yes", "y", "on")
FALSE_WORDS = ("0", "false", "no", "n", "off")
"""The boolean spellings, in the environment, the config file and ``accel config`` alike
(case-insensitive)."""


def parse_bool(text: str) -> bool | None:
    """``True``/``False`` for a boolean spelling (any case, spaces ignored), else ``None``.

    Example:
        >>> parse_bool(" Yes "), parse_bool("0"), parse_bool("maybe")
        (True, False, None)
    """
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``key``, else ``""``.

    Example:
        >>> did_you_mean("mixed_precison", ["mixed_precision", "strategy"])
        " (did you mean 'mixed_precision'?)"
    """
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1.

    Example:
        >>> cpu_count() >= 1
        True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# DDP options (Accelerate's DistributedDataParallelKwargs); accel.parallel.ddp applies them.
DDP_KEYWORDS = (
    "find_unused_parameters", "static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
    "broadcast_buffers",
)
"""Keywords passed to ``DistributedDataParallel`` as given."""
DDP_HOOK_KEYS = ("comm_hook", "comm_wrapper", "comm_state_option", "comm_state")
"""A communication hook with its wrapper and state (a callable or an object: code only)."""
FSDP_KEYS = ("shard_modules", "reshard_after_forward", "cpu_offload")
"""The strategy options of ``strategy="fsdp"``."""
DEEPSPEED_KEYS = (
    "deepspeed_config", "zero_stage", "offload_optimizer", "offload_params", "gradient_clipping",
)
"""The options of ``strategy="deepspeed"`` (``accel.parallel.deepspeed`` reads them from
``accel.state().options``; ``deepspeed_config`` may also be a dict there)."""
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""Where DeepSpeed's ZeRO offloads optimizer states or parameters."""
COMM_HOOKS = ("no", "fp16", "bf16", "power_sgd", "batched_power_sgd")
COMM_WRAPPERS = ("no", "fp16", "bf16")
POWER_SGD_OPTIONS: Mapping[str, tuple[type, int]] = {
    "matrix_approximation_rank": (int, 1),
    "start_powerSGD_iter": (int, 0),
    "min_compression_rate": (float, 0),
    "use_error_feedback": (bool, 0),
    "warm_start": (bool, 0),
    "orthogonalization_epsilon": (float, 0),
    "random_seed": (int, 0),
    "compression_stats_logging_frequency": (int, 1),
    "batch_tensors_with_same_shape": (bool, 0),
}
"""``comm_state_option`` keys (``PowerSGDState``'s arguments after ``process_group``): type
and minimum."""


Kind = Literal["int", "float", "bool", "str", "choice", "table", "blocks"]
Layer = Literal["launch", "policy", "ddp", "model"]
CodeKind = Literal["instance", "callable"]


@attrs.frozen
class CodeValue:
    """What code may give ``distributed()`` for an option beyond what a file or a variable holds.

    ``accel.core.options.code_option`` checks it at block entry, importing nothing: kind
    ``"instance"`` (of a setting with choices) is one of the setting's choices in any case
    (``None``: its default) or an instance of the class at :attr:`type_path`, found in
    ``sys.modules`` (a user who made one has imported it); kind ``"callable"`` is ``None`` or
    a callable. The message reads ``"{origin}: {key}={value!r} is not {noun}; [choose one of
    the choices or] pass {hint}, e.g. `{example}`."``.

    Example:
        >>> SETTINGS["fp8_recipe"].code.type_path
        'torchao.float8.config:Float8LinearConfig'
    """

    kind: CodeKind
    noun: str
    """What the value is not, for the message (``"a recipe"``, ``"callable"``)."""
    hint: str
    """What to pass instead, for the message."""
    example: str
    """A ``distributed()`` call with a good value, for the message."""
    type_path: str = ""
    """``"module:Class"``, the class of kind ``"instance"``."""


@attrs.frozen
class Spec:
    """One setting: its kind, meaning, default (``None``: decided at run time) and limits.

    ``layer`` says who reads it: ``"launch"`` (``accel launch`` only), ``"policy"``
    (``accel.distributed()``, also as an ``ACCEL_*`` variable), ``"ddp"`` (a DDP option) or
    ``"model"`` (a ``prepare_model`` or engine option run-wide: ``accel.state().options``,
    also as an ``ACCEL_*`` variable). Kind ``"blocks"`` is true/false or module class names.
    ``mode`` names the mixed precision mode whose option it is (``accel launch`` offers it as
    ``--<key>`` among the training options); ``code`` what code may also give for it.
    """

    kind: Kind
    help: str
    default: object = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    layer: Layer = "launch"
    mode: MixedPrecision | None = None
    code: CodeValue | None = None


SETTINGS: Mapping[str, Spec] = {
    # where the processes run (used by `accel launch`)
    "num_machines": Spec("int", "machines (nodes) in the job", 1, minimum=1),
    "num_processes": Spec(
        "int", "processes in total, across all machines (default: one per GPU, else "
        f"{DEFAULT_CPU_PROCESSES})", minimum=1,
    ),
    "machine_rank": Spec("int", "rank of this machine, 0 for the main one", 0, minimum=0),
    "main_process_ip": Spec("str", "address of machine 0 (several machines)"),
    "main_process_port": Spec(
        "int", f"port on machine 0 (default: a free port on one machine, else {DEFAULT_PORT})",
        minimum=1, maximum=65535,
    ),
    "max_restarts": Spec("int", "times the job restarts after a process fails", 0, minimum=0),
    "rendezvous_timeout": Spec(
        "float", "seconds accel launch waits at start-up for every machine before naming those "
        "that never arrived", DEFAULT_RENDEZVOUS_TIMEOUT_S, minimum=1.0,
    ),
    # the run-wide policy (read by accel.distributed(), also as ACCEL_<KEY>)
    "mixed_precision": Spec(
        "choice", "autocast precision (fp8: torchao float8 Linear layers, bf16 around them)",
        "no", choices=MIXED_PRECISION_MODES, layer="policy",
    ),
    "gradient_accumulation_steps": Spec(
        "int", "batches per optimizer step", 1, minimum=1, layer="policy"
    ),
    "strategy": Spec(
        "choice", "how models are wrapped: none, ddp, fsdp or deepspeed (default: ddp with several "
        "processes, else none)",
        choices=STRATEGIES, layer="policy",
    ),
    "backend": Spec(
        "choice", "torch.distributed backend (default: nccl on CUDA, gloo on CPU)",
        choices=BACKENDS, layer="policy",
    ),
    "cpu": Spec("bool", "run on the CPU even where GPUs are available", False, layer="policy"),
    "debug": Spec(
        "bool", "check every collective across ranks first (slower)", False, layer="policy"
    ),
    "timeout": Spec(
        "float", "seconds before a collective gives up", DEFAULT_TIMEOUT_S, minimum=0.0,
        layer="policy",
    ),
    "arrival_timeout": Spec(
        "float", "seconds a rank waits at save_state/load_state/main_process_first for the "
        "ranks that never arrive before naming them (a call inside `if is_main_process:`)",
        DEFAULT_ARRIVAL_TIMEOUT_S, minimum=0.0, layer="policy",
    ),
    "heartbeat_interval": Spec(
        "float", "seconds between the liveness stamps of each process (several machines)",
        DEFAULT_HEARTBEAT_INTERVAL_S, minimum=0.01, layer="policy",
    ),
    "liveness_timeout": Spec(
        "float", "seconds a machine may go unheard before the others end the job naming it "
        "(several machines; 0: no watch)", DEFAULT_LIVENESS_TIMEOUT_S, layer="policy",
    ),
    "on_each_node": Spec(
        "bool", "each machine's first process saves its own copy (no shared filesystem)", False,
        layer="policy",
    ),
    # elastic jobs: run-wide, kept in accel.state().options (read by accel.distributed())
    "keep_global_batch": Spec(
        "int", "the world size (processes) gradient_accumulation_steps and the per-rank batch "
        "are written for; at another world size the accumulation steps are scaled to keep the "
        "global batch (elastic restarts)", minimum=1, layer="model",
    ),
    # the device mesh (read by accel.distributed(), also as ACCEL_<KEY>)
    "dp_replicate_size": Spec(
        "int", "mesh: data-parallel replicas (HSDP's replicate dimension)", minimum=1,
        layer="policy",
    ),
    "dp_shard_size": Spec(
        "int", "mesh: processes each model is sharded over with FSDP", minimum=1,
        layer="policy",
    ),
    "tp_size": Spec("int", "mesh: tensor-parallel degree", minimum=1, layer="policy"),
    "cp_size": Spec(
        "int", "mesh: context-parallel degree (processes that split each sequence)", minimum=1,
        layer="policy",
    ),
    "pp_size": Spec("int", "mesh: pipeline-parallel stages", minimum=1, layer="policy"),
    "cp_method": Spec(
        "choice", "context parallel attention: alltoall (any device) or ring (CUDA); default "
        "ring on CUDA, else alltoall", choices=CP_METHODS, layer="policy",
    ),
    # DDP options (read by accel.prepare_model where it wraps a model in DDP)
    "find_unused_parameters": Spec(
        "bool", "DDP: allow parameters with no gradient", False, layer="ddp"
    ),
    "static_graph": Spec("bool", "DDP: the graph is the same every step", False, layer="ddp"),
    "gradient_as_bucket_view": Spec(
        "bool", "DDP: gradients are views of its buckets", False, layer="ddp"
    ),
    "bucket_cap_mb": Spec(
        "float", "DDP: all-reduce bucket size in MB", 25.0, minimum=0.0, layer="ddp"
    ),
    "broadcast_buffers": Spec(
        "bool", "DDP: copy rank 0's buffers to the others", True, layer="ddp"
    ),
    "comm_hook": Spec(
        "choice", "DDP: gradient communication", "no", choices=COMM_HOOKS, layer="ddp"
    ),
    "comm_wrapper": Spec(
        "choice", "DDP: cast the hook's input", "no", choices=COMM_WRAPPERS, layer="ddp"
    ),
    "comm_state_option": Spec(
        "table", "DDP: PowerSGD options (an inline table)", {}, layer="ddp"
    ),
    # model options (read by accel.prepare_model, also as ACCEL_<KEY>)
    "activation_checkpointing": Spec(
        "blocks", "recompute each block's activations in the backward (true, or block class "
        "names)", False, layer="model",
    ),
    "fp8_recipe": Spec(  # a precision mode's option: mode= (and code= what code may give)
        "choice", "torchao float8 recipe under mixed_precision='fp8'", "tensorwise",
        choices=FP8_RECIPES, layer="model", mode="fp8",
        code=CodeValue(
            "instance", "a recipe", "a `torchao.float8.Float8LinearConfig`",
            "accel.distributed(mixed_precision='fp8', fp8_recipe='rowwise')",
            type_path="torchao.float8.config:Float8LinearConfig",
        ),
    ),
    # DeepSpeed (strategy="deepspeed"; read by accel.parallel.deepspeed, also as ACCEL_<KEY>)
    "deepspeed_config": Spec(
        "str", "DeepSpeed: the JSON config file (strategy deepspeed)", layer="model",
    ),
    "zero_stage": Spec(
        "int", "DeepSpeed: ZeRO stage 0-3 (fills or checks the config's)", minimum=0,
        maximum=3, layer="model",
    ),
    "offload_optimizer": Spec(
        "choice", "DeepSpeed: where ZeRO offloads optimizer states", choices=OFFLOAD_DEVICES,
        layer="model",
    ),
    "offload_params": Spec(
        "choice", "DeepSpeed: where ZeRO-3 offloads parameters", choices=OFFLOAD_DEVICES,
        layer="model",
    ),
    "gradient_clipping": Spec(
        "float", "DeepSpeed: the gradient norm clip its 'auto' takes (0: none)",
        layer="model",
    ),
}
"""Every config key, its kind, meaning, default (``None``: decided at run time) and limits."""

POLICY_KEYS = tuple(key for key, spec in SETTINGS.items() if spec.layer == "policy")
"""The settings ``accel.distributed()`` reads: argument > ``ACCEL_<KEY>`` > config file."""
DDP_CONFIG_KEYS = tuple(key for key, spec in SETTINGS.items() if spec.layer == "ddp")
"""The DDP options a config file can hold (a callable hook or a state object cannot)."""
MODEL_KEYS = tuple(key for key, spec in SETTINGS.items() if spec.layer == "model")
"""The ``prepare_model`` options set run-wide: argument > ``ACCEL_<KEY>`` > config file."""
PRECISION_KEYS = tuple(key for key, spec in SETTINGS.items() if spec.mode is not None)
"""The precision modes' settings (``accel launch --<key>``, ``ACCEL_<KEY>``, the config file)."""

PRECISION_CODE_OPTIONS: Mapping[str, CodeValue] = {
    "fp8_module_filter": CodeValue(
        "callable", "callable", "a function `filter(module, name) -> bool` that returns True "
        "for the nn.Linear layers to run in fp8",
        "accel.distributed(mixed_precision='fp8', "
        "fp8_module_filter=lambda module, name: 'head' not in name)",
    ),
}
"""Options of the precision units that only code can give (a callable): ``distributed()``
keywords, read from ``accel.state().options``."""
PRECISION_CODE_KEYS = tuple(PRECISION_CODE_OPTIONS)
CODE_VALUES: Mapping[str, CodeValue] = {
    **{key: spec.code for key, spec in SETTINGS.items() if spec.code is not None},
    **PRECISION_CODE_OPTIONS,
}
"""Every option whose value from code ``distributed()`` checks as its :class:`CodeValue` says."""


def env_variable(key: str) -> str:
    """The environment variable of a policy setting.

    Example:
        >>> env_variable("mixed_precision")
        'ACCEL_MIXED_PRECISION'
    """
    return ENV_PREFIX + key.upper()

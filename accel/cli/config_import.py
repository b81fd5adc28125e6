"""``accel config import``: an Accelerate config file (YAML or JSON) to accel's TOML config.

Every key of the Accelerate file (the keys of Accelerate 1.15's ``ClusterConfig`` and
``SageMakerConfig``) gets one outcome: **mapped** to an accel setting, **not needed** (its
value is what accel does anyway), or **not imported**, with the reason and what to do instead.
A key Accelerate itself does not know is an error, as in Accelerate, and so is a value accel's
setting refuses: then nothing is written. The TOML file is written atomically.

YAML is read with PyYAML's safe loader (no object construction), from the optional extra
``accel[yaml]``; accel never needs PyYAML otherwise. JSON config files (Accelerate reads
those too) need nothing.

The file is read as untrusted input (:mod:`accel.cli.config_reading`: bounded size and
nesting, no YAML anchors or aliases). The report shows a value longer than :data:`_PREVIEW`
characters as a preview of that length.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from accel.cli.config_reading import clip, read_config_file
from accel.core.config_file import check_consistency, config_path
from accel.core.env import environ_snapshot
from accel.core.setting_values import validate_setting
from accel.core.settings import did_you_mean
from accel.errors import ConfigError

__all__ = [
    "ImportResult", "Outcome", "accelerate_config_path", "import_accelerate_config", "map_keys",
    "toml_text",
]

_PREVIEW = 200  # characters of a value's repr that the report shows

# Accelerate 1.15: BaseConfig + ClusterConfig fields, SageMakerConfig fields, legacy keys that
# its loader converts (fp16, dynamo_backend).
_CLUSTER = (
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
    "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
    "main_process_port", "rdzv_backend", "same_network", "main_training_function",
    "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config",
    "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm",
    "tpu_env", "dynamo_config", "fp16", "dynamo_backend",
)
_SAGEMAKER = (
    "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "base_job_name",
    "pytorch_version", "transformers_version", "py_version", "sagemaker_inputs_file",
    "sagemaker_metrics_file", "additional_args",
)
_STRATEGY = {
    "NO": "none", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "FSDP": "fsdp",
    "DEEPSPEED": "deepspeed",
}
# Accelerate's deepspeed_config keys that are accel settings
_DEEPSPEED = {
    "deepspeed_config_file": "deepspeed_config", "zero_stage": "zero_stage",
    "offload_optimizer_device": "offload_optimizer", "offload_param_device": "offload_params",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}
_DEEPSPEED_REASONS = {
    "zero3_init_flag": "a code change, not a setting: build the model inside "
    "`with accel.init_partitioned():` (docs/deepspeed.md)",
    "zero3_save_16bit_model": "accel.save_model under ZeRO-3 gathers the full weights anyway",
    "deepspeed_multinode_launcher": "accel launch runs torchrun on each machine",
    "deepspeed_hostfile": "accel launch runs torchrun on each machine (no hostfile)",
    "deepspeed_exclusion_filter": "accel launch runs torchrun on each machine (no hostfile)",
    "deepspeed_inclusion_filter": "accel launch runs torchrun on each machine (no hostfile)",
}
_DIRECT = {
    "num_processes": "num_processes", "num_machines": "num_machines",
    "machine_rank": "machine_rank", "main_process_ip": "main_process_ip",
    "main_process_port": "main_process_port", "use_cpu": "cpu", "debug": "debug",
}
_FSDP_REASONS = {
    "fsdp_version": "accel's FSDP is FSDP2 (torch's fully_shard); FSDP1 options do not apply",
    "fsdp_auto_wrap_policy": "no config key: accel shards the model's declared blocks "
    "(transformers' _no_split_modules) by default; choose others with "
    "`accel.prepare_model(model, shard_modules=[...])`",
    "fsdp_transformer_layer_cls_to_wrap": "no config key: pass the class names as "
    "`accel.prepare_model(model, shard_modules=[...])` (the default is the model's "
    "_no_split_modules, which these usually are)",
    "fsdp_min_num_params": "size-based wrapping is not supported; name the blocks with "
    "`shard_modules=`",
    "fsdp_reshard_after_forward": "no config key: pass "
    "`accel.distributed(reshard_after_forward=...)` or `prepare_model(..., "
    "reshard_after_forward=...)`",
    "fsdp_offload_params": "no config key: pass `accel.distributed(cpu_offload=True)` or "
    "`prepare_model(..., cpu_offload=True)`",
    "fsdp_state_dict_type": "save_state writes each rank's shards and loads them at any world "
    "size; save_model writes full weights",
    "fsdp_cpu_ram_efficient_loading": "not supported as a setting: build the model under "
    "`accel.init_empty_weights()` and load weights with `accel.load_checkpoint_in_model`",
    "fsdp_sync_module_states": "accel does not broadcast rank 0's weights under FSDP: "
    "fully_shard shards each process's own copy, so build the same model on every process "
    "(`distributed(seed=...)`, or load the same weights)",
    "fsdp_activation_checkpointing": "not supported: enable it on the model "
    "(`model.gradient_checkpointing_enable()` for transformers)",
    "fsdp_sharding_strategy": "SHARD_GRAD_OP is `reshard_after_forward=False` (pass it to "
    "distributed() or prepare_model); NO_SHARD is `strategy = \"ddp\"`; HYBRID_SHARD is not "
    "supported",
    "fsdp_forward_prefetch": "FSDP2 prefetches the next block's all-gather itself",
    "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
}


# FSDP options whose value is what accel does anyway: (values, why)
_FSDP_SAME: dict[str, tuple[tuple[Any, ...], str]] = {
    "fsdp_version": ((2, "2"), "accel's FSDP is FSDP2"),
    "fsdp_auto_wrap_policy": (("TRANSFORMER_BASED_WRAP",), "accel shards the model's declared "
                              "blocks (transformers' _no_split_modules) by default"),
    "fsdp_offload_params": ((False,), "accel does not offload unless asked"),
    "fsdp_reshard_after_forward": ((True, "FULL_SHARD"), "accel reshards after forward by "
                                   "default"),
    "fsdp_activation_checkpointing": ((False,), "off in accel too"),
    "fsdp_cpu_ram_efficient_loading": ((False,), "off in accel too"),
    "fsdp_sync_module_states": ((False,), "off in accel too"),
    "fsdp_use_orig_params": ((True,), "FSDP2 always keeps the original parameters"),
    "fsdp_sharding_strategy": (("FULL_SHARD", 1), "FSDP2 shards parameters, gradients and "
                               "optimizer states (FULL_SHARD)"),
    "fsdp_backward_prefetch": (("BACKWARD_PRE", "BACKWARD_POST"), "FSDP2 prefetches the next "
                               "block's all-gather itself"),
    "fsdp_forward_prefetch": ((False,), "off in accel too"),
    "fsdp_min_num_params": ((0,), "no size-based wrapping"),
}


@attrs.frozen
class Outcome:
    """What became of one key: ``status`` is ``"mapped"``, ``"not needed"`` or
    ``"not imported"``; ``setting`` and ``written`` the accel key and value it became
    (mapped only)."""

    key: str
    value: Any
    status: str
    setting: str | None = None
    reason: str = ""
    written: object = None


@attrs.frozen
class ImportResult:
    """What :func:`import_accelerate_config` read, mapped and wrote."""

    source: Path
    target: Path | None
    settings: dict[str, object]
    outcomes: tuple[Outcome, ...]


def accelerate_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where Accelerate keeps its default config: ``$HF_HOME/accelerate/default_config.yaml``,
    else ``$XDG_CACHE_HOME/huggingface/accelerate/...``, else ``~/.cache/huggingface/...``.

    Example:
        >>> accelerate_config_path({"HF_HOME": "/hf"})
        PosixPath('/hf/accelerate/default_config.yaml')
    """
    env = environ_snapshot() if environ is None else environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = env.get("HF_HOME") or os.path.join(cache, "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


@attrs.frozen
class _Preview:
    """Stands for a long value in the report: its ``repr`` is the first characters of the
    value's (``outcome.value!r`` prints at most about :data:`_PREVIEW` characters)."""

    text: str

    def __repr__(self) -> str:
        return self.text


def _shown(value: Any) -> Any:
    """``value``, or a :class:`_Preview` of it when its ``repr`` is long."""
    text = repr(value)
    return value if len(text) <= _PREVIEW else _Preview(clip(text))


def _empty(value: Any) -> bool:
    return value in (None, False, "no", "NO", "all", "", [], {}, "static", "main", "LOCAL_MACHINE")


def _fsdp(config: Any) -> list[Outcome]:
    if not isinstance(config, Mapping):
        return [Outcome("fsdp_config", config, "not imported", reason="not a mapping")]
    found = []
    for key, value in config.items():
        name = f"fsdp_config.{key}"
        same = _FSDP_SAME.get(str(key))
        if same is not None and value in same[0]:
            found.append(Outcome(name, value, "not needed", reason=same[1]))
        elif key == "fsdp_state_dict_type":
            found.append(Outcome(name, value, "not needed", reason=_FSDP_REASONS[key]))
        else:
            reason = _FSDP_REASONS.get(str(key), "an FSDP option without an accel config key; "
                                       "see docs/fsdp.md for the options prepare_model takes")
            found.append(Outcome(name, value, "not imported", reason=reason))
    return found


_FP8_BACKENDS = {"AO": "torchao", "TE": "Transformer Engine", "MSAMP": "MS-AMP"}
_FP8_REASONS = {
    "enable_fsdp_float8_all_gather": "accel turns torchao's float8 all-gather on itself under "
    "FSDP2 with the tensorwise recipe",
    "pad_inner_dim": "no config key: pass `fp8_recipe=Float8LinearConfig(pad_inner_dim=True)` "
    "to accel.distributed()",
}


def _fp8(config: Any, origin: str, settings: dict[str, object]) -> list[Outcome]:
    """``fp8_config``: every backend becomes torchao's float8 training (``fp8_recipe``)."""
    if not isinstance(config, Mapping):
        return [Outcome("fp8_config", config, "not imported", reason="not a mapping")]
    found = []
    for key, value in config.items():
        name = f"fp8_config.{key}"
        if key == "backend":
            backend = str(value).upper()
            used = _FP8_BACKENDS.get(backend)
            if used is None:
                found.append(Outcome(name, value, "not imported", reason=(
                    f"not an Accelerate fp8 backend ({'/'.join(_FP8_BACKENDS)})")))
                continue
            settings["fp8_recipe"] = _validated("fp8_recipe", "tensorwise", f"{origin}: {name}")
            reason = ("torchao's tensorwise recipe, as Accelerate's AO default" if backend == "AO"
                      else f"accel uses torchao's float8 training, not {used}: the tensorwise "
                      "recipe (delayed-scaling options do not apply)")
            found.append(Outcome(name, value, "mapped", "fp8_recipe", reason, "tensorwise"))
        elif key in _FP8_REASONS:
            status = "not needed" if key == "enable_fsdp_float8_all_gather" else "not imported"
            if key == "pad_inner_dim" and not value:
                status = "not needed"
            found.append(Outcome(name, value, status, reason=_FP8_REASONS[str(key)]))
        else:
            found.append(Outcome(name, value, "not imported", reason=(
                "a Transformer Engine / MS-AMP option: torchao's float8 training scales "
                "dynamically (no amax history, margin or optimization level)")))
    return found


def _deepspeed(config: Any, origin: str, settings: dict[str, object]) -> list[Outcome]:
    """``deepspeed_config``: the config file, ZeRO stage, offload devices and clipping."""
    if not isinstance(config, Mapping):
        return [Outcome("deepspeed_config", config, "not imported", reason="not a mapping")]
    found = []
    for key, value in config.items():
        name = f"deepspeed_config.{key}"
        accel_key = _DEEPSPEED.get(str(key))
        if accel_key is not None and value is not None:
            settings[accel_key] = _validated(accel_key, value, f"{origin}: {name}")
            found.append(Outcome(name, value, "mapped", accel_key, "", settings[accel_key]))
        elif value in (None, False, "none", ""):
            found.append(Outcome(name, value, "not needed", reason="off in accel too"))
        else:
            reason = _DEEPSPEED_REASONS.get(str(key), "a DeepSpeed option without an accel "
                                            "key: put it in the DeepSpeed JSON config "
                                            "(deepspeed_config)")
            found.append(Outcome(name, _shown(value), "not imported", reason=reason))
    return found


def _validated(accel_key: str, value: Any, where: str) -> object:
    """``validate_setting``, refusing first a value too long for any setting (the error
    message would quote it whole)."""
    text = repr(value)
    if len(text) > _PREVIEW:
        raise ConfigError(
            f"{where}={clip(text)} is too long for the setting {accel_key!r} (no value of it "
            f"is over {_PREVIEW} characters). Fix that key (`accelerate config` writes a valid "
            "file). Nothing was written."
        )
    return validate_setting(accel_key, value, where)


def _parallelism(
    config: Mapping[str, Any], origin: str, settings: dict[str, object]
) -> list[Outcome]:
    """``parallelism_config``'s mesh sizes as accel's ``*_size`` settings (into ``settings``)."""
    found = []
    for key, value in config.items():
        name = f"parallelism_config.{key}"
        size = str(key).removeprefix("parallelism_config_")
        if size == "cp_size" and value in (None, 1):
            found.append(Outcome(name, value, "not needed", reason="no context parallelism"))
        elif size in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size"):
            settings[size] = _validated(size, value, f"{origin}: {name}")
            found.append(Outcome(name, value, "mapped", size, "", settings[size]))
        else:
            found.append(Outcome(name, value, "not imported", reason=(
                "accel has no such setting (sp sizes and backends, the cp handler's ring "
                "rotation): accel's `cp_method` chooses alltoall or ring attention")))
    return found


def _other(key: str, value: Any) -> Outcome:
    if _empty(value):
        return Outcome(key, value, "not needed", reason="the value is what accel does anyway")
    shown = clip(str(value), 80) if key in ("gpu_ids", "rdzv_backend") else ""
    reasons: dict[str, str] = {
        "compute_environment": "SageMaker is not supported; accel runs where it is launched",
        "gpu_ids": f"no config key: launch with `CUDA_VISIBLE_DEVICES={shown}`",
        "rdzv_backend": f"no config key: pass `accel launch --rdzv-backend {shown}`",
        "same_network": "not needed: accel launch runs torchrun on each machine",
        "main_training_function": "used by TPU launches only; accel has no TPU support",
        "enable_cpu_affinity": "not supported; pin with `taskset`/`numactl` if you need it",
        "dynamo_config": "no config key: pass `accel.prepare_model(model, compile={...})` "
        "with the dynamo options",
        "dynamo_backend": "no config key: pass `accel.prepare_model(model, compile={'backend': "
        "...})`",
        "megatron_lm_config": "accel has no Megatron-LM integration",
        "parallelism_config": "not a mapping of parallelism_config_* sizes",
        "mpirun_config": "run `mpirun -hostfile F -n N python train.py` yourself; "
        "accel.distributed() reads the MPI variables",
    }
    reason = reasons.get(key)
    if reason is None:
        reason = ("SageMaker is not supported" if key in _SAGEMAKER
                  else "TPU options: accel has no TPU support")
    return Outcome(key, value, "not imported", reason=reason)


def map_keys(data: Mapping[str, Any], origin: str) -> tuple[dict[str, object], list[Outcome]]:
    """Map an Accelerate config's keys to accel settings; the settings and every outcome.

    Raises:
        ConfigError: a key Accelerate does not know, or a value accel's setting refuses.

    Example:
        >>> map_keys({"distributed_type": "MULTI_GPU", "num_processes": 8}, "cfg")[0]
        {'strategy': 'ddp', 'num_processes': 8}
    """
    known = set(_CLUSTER) | set(_SAGEMAKER)
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        hints = []
        for key in unknown[:10]:
            hint = did_you_mean(key, known) if len(key) <= 100 else ""
            hints.append(f"{clip(repr(key), 80)}{hint}")
        if len(unknown) > 10:
            hints.append(f"and {len(unknown) - 10} more")
        raise ConfigError(
            f"{origin} has keys Accelerate 1.15 does not know: {', '.join(hints)}. Accelerate "
            "refuses this file too; fix or remove those keys (`accelerate config` writes a valid "
            "file). Nothing was written."
        )
    settings: dict[str, object] = {}
    outcomes: list[Outcome] = []

    def setting(key: str, value: Any, accel_key: str, reason: str = "") -> None:
        settings[accel_key] = _validated(accel_key, value, f"{origin}: {key}")
        outcomes.append(
            Outcome(key, data[key], "mapped", accel_key, reason, settings[accel_key]))

    for key, value in data.items():
        if key in _DIRECT:
            if value is None or (key == "num_processes" and value == -1):
                outcomes.append(Outcome(key, value, "not needed", reason="decided at launch"))
            else:
                setting(key, value, _DIRECT[key])
        elif key == "distributed_type":
            # an unquoted NO is YAML 1.1's false (Accelerate writes it quoted)
            mapped = _STRATEGY.get("NO" if value is False else str(value).upper())
            if mapped is None:
                outcomes.append(Outcome(key, value, "not imported", reason=(
                    "accel runs DDP, FSDP or DeepSpeed on CUDA GPUs and CPUs only (no "
                    "Megatron-LM, XLA/TPU or other devices)")))
            else:
                setting(key, mapped, "strategy")
        elif key == "mixed_precision":
            if value is None:
                outcomes.append(Outcome(key, value, "not needed", reason="none asked for"))
            else:
                note = ("torchao float8 training (accel[fp8])" if str(value).lower() == "fp8"
                        else "")
                setting(key, str(value), "mixed_precision", note)
        elif key == "fp16":
            if value:
                setting(key, "fp16", "mixed_precision", "Accelerate's old spelling")
            else:
                outcomes.append(Outcome(key, value, "not needed", reason="fp16 off"))
        elif key == "fsdp_config":
            outcomes += _fsdp(value) if value else [
                Outcome(key, value, "not needed", reason="empty")]
            if isinstance(value, Mapping) and value.get("fsdp_activation_checkpointing") is True:
                settings["activation_checkpointing"] = True
                outcomes = [o for o in outcomes
                            if o.key != "fsdp_config.fsdp_activation_checkpointing"]
                outcomes.append(Outcome(
                    "fsdp_config.fsdp_activation_checkpointing", True, "mapped",
                    "activation_checkpointing", "the blocks FSDP shards", True))
        elif key == "deepspeed_config":
            outcomes += _deepspeed(value, origin, settings) if value else [
                Outcome(key, value, "not needed", reason="empty")]
        elif key == "fp8_config":
            outcomes += _fp8(value, origin, settings) if value else [
                Outcome(key, value, "not needed", reason="empty")]
        elif key == "parallelism_config" and isinstance(value, Mapping):
            outcomes += _parallelism(value, origin, settings)
        else:
            outcomes.append(_other(key, value))
    check_consistency(settings, origin)
    return settings, outcomes


def _write(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    except BaseException:
        if partial.exists():
            partial.unlink()
        raise


def toml_text(settings: Mapping[str, object], source: Path) -> str:
    """The accel config file for ``settings``, saying which file it was imported from."""
    from accel.core.config_file import dump_config

    shown = "".join(c if c.isprintable() else "?" for c in os.fspath(source))
    return dump_config(settings).replace(
        "(written by `accel config`)", f"(imported from {shown} by `accel config import`)", 1)


def import_accelerate_config(
    source: str | os.PathLike[str] | None = None,
    target: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    write: bool = True,
    report: Callable[[Outcome], None] | None = None,
) -> ImportResult:
    """Read an Accelerate config and write the equivalent accel TOML config file.

    Args:
        source: the Accelerate file (``.yaml``/``.yml`` or ``.json``); default Accelerate's
            default config (:func:`accelerate_config_path`).
        target: the accel config file to write; default ``$ACCEL_CONFIG_FILE``, else
            ``$XDG_CONFIG_HOME/accel/config.toml``.
        force: replace an existing ``target``.
        write: ``False`` maps and reports only (nothing is written).
        report: called with each key's outcome, in the file's order; a value (or key) whose
            ``repr`` is over 200 characters is given as a preview of that length.

    Raises:
        ConfigError: the file is missing, unreadable, over 1 MiB, nests over 32 levels, holds
            YAML anchors or aliases, is not a mapping, holds a key Accelerate does not know or
            a value accel refuses, PyYAML is missing for a YAML file, or ``target`` exists
            (without ``force``). Nothing is written then.

    Example:
        >>> import_accelerate_config("default_config.yaml", "accel.toml").settings
        {'strategy': 'fsdp', 'mixed_precision': 'bf16', 'num_processes': 8}
    """
    path = accelerate_config_path() if source is None else Path(source).expanduser()
    settings, outcomes = map_keys(read_config_file(path), os.fspath(path))
    for outcome in outcomes:
        if report is not None:
            report(attrs.evolve(outcome, key=clip(outcome.key), value=_shown(outcome.value)))
    out: Path | None = None
    if write:
        out, _ = config_path(target)
        if os.path.lexists(out) and not force:
            raise ConfigError(
                f"{os.fspath(out)} already exists; not overwritten. Pass --force to replace it, "
                "or --config-file to write elsewhere. Nothing was written."
            )
        _write(out, toml_text(settings, path))
    return ImportResult(path, out, settings, tuple(outcomes))

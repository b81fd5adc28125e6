"""The DeepSpeed config a run uses: the user's (a JSON path or a dict), accel's shortcuts, and
every ``"auto"`` filled from accel's settings.

What each ``"auto"`` becomes (also in ``docs/deepspeed.md``):

- ``gradient_accumulation_steps``: ``accel.state().gradient_accumulation_steps`` (a number
  there must equal it: ``accel.accumulate`` decides the sync steps);
- ``train_micro_batch_size_per_gpu``: the batch size of the loader prepared with the model;
  ``train_batch_size``: micro batch x accumulation steps x processes;
- ``bf16.enabled`` / ``fp16.enabled``: from ``mixed_precision``;
- ``gradient_clipping``: accel's ``gradient_clipping`` option, else the loop's first
  ``accel.clip_grad_norm_`` (0, no clipping, until then). A missing key counts as ``"auto"``
  (DeepSpeed's own default would clip at 1.0, which a loop that does not clip never asked for);
- ``zero_optimization.reduce_bucket_size`` / ``stage3_prefetch_bucket_size`` /
  ``stage3_param_persistence_threshold``: from the model's ``config.hidden_size`` as
  Accelerate does (h*h, 0.9*h*h, 10*h).

Anything else left ``"auto"`` is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from accel.core.config_file import DEEPSPEED_CONFIG_MAX_DEPTH, load_deepspeed_json
from accel.core.settings import OFFLOAD_DEVICES
from accel.errors import ConfigError
from accel.parallel.deepspeed.keys import check_keys
from accel.parallel.deepspeed.sections import Client, reconcile

__all__ = [
    "AUTO", "Facts", "Resolved", "build_config", "load_config", "partition_config",
    "resolve_config", "zero_stage",
]

AUTO = "auto"
_EXAMPLE = "`accel.distributed(strategy='deepspeed', deepspeed_config='ds_config.json')`"


@attrs.frozen(kw_only=True)
class Facts:
    """What accel knows that fills the config's ``"auto"`` values.

    Example:
        >>> Facts(mixed_precision="no", gradient_accumulation_steps=1, world_size=2,
        ...       micro_batch=8).world_size
        2
    """

    mixed_precision: str
    gradient_accumulation_steps: int
    world_size: int
    micro_batch: int | None = None
    gradient_clipping: float | None = None
    hidden_size: int | None = None
    client_optimizer: bool = True
    client: Client | None = None
    """The loop's own optimizer and scheduler, which settle the config's optimizer and
    scheduler sections (:mod:`~accel.parallel.deepspeed.sections`)."""


@attrs.frozen(kw_only=True)
class Resolved:
    """The config for ``deepspeed.initialize`` and whether the loop's clip sets its clipping.

    Example:
        >>> Resolved(config={}, clip_from_loop=True).clip_from_loop
        True
    """

    config: Mapping[str, Any]
    clip_from_loop: bool


def _shallow_enough(config: Mapping[str, Any]) -> None:
    """Refuse a config given in code nested deeper than a file may be (found without
    recursion, so a deep or self-containing dict is a ConfigError, not a RecursionError)."""
    limit = DEEPSPEED_CONFIG_MAX_DEPTH
    stack: list[tuple[object, int]] = [(config, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ConfigError(
                f"The DeepSpeed config given as a dict: its dicts and lists nest more than "
                f"{limit} levels deep (DeepSpeed's nest 3 or 4); pass the config itself, e.g. "
                "`deepspeed_config={\"zero_optimization\": {\"stage\": 2}}`."
            )
        items = node.values() if isinstance(node, Mapping) else (
            node if isinstance(node, list | tuple) else ())
        stack.extend((item, depth + 1) for item in items
                     if isinstance(item, Mapping | list | tuple))


def load_config(source: object) -> dict[str, Any]:
    """The user's DeepSpeed config: a copy of a dict, or a JSON file read (``None``: empty).

    A file is read by :func:`accel.core.config_file.load_deepspeed_json`: a regular file only
    (never a FIFO or a device), at most 4 MiB, UTF-8 JSON nested at most 64 deep, no key
    twice. A dict nested deeper is refused too.

    Raises:
        ConfigError: the file is missing, not a regular file, too large, not UTF-8 JSON or not
            a JSON object, a key is in it twice, it nests too deep, or ``source`` is neither.

    Example:
        >>> load_config({"zero_optimization": {"stage": 2}})
        {'zero_optimization': {'stage': 2}}
    """
    if source is None:
        return {}
    if isinstance(source, Mapping):
        _shallow_enough(source)
        return copy.deepcopy(dict(source))
    if not isinstance(source, str | os.PathLike):
        raise ConfigError(
            f"deepspeed_config={source!r} must be a path to a DeepSpeed JSON file or a dict, "
            f"e.g. {_EXAMPLE}."
        )
    return load_deepspeed_json(source)


def _offload(zero: dict[str, Any], key: str, device: object, option: str) -> None:
    if device is None:
        return
    if device not in OFFLOAD_DEVICES:
        raise ConfigError(
            f"{option}={device!r} is invalid; choose one of {list(OFFLOAD_DEVICES)}, e.g. "
            f"`accel.distributed(strategy='deepspeed', zero_stage=3, {option}='cpu')`."
        )
    section = zero.get(key)
    given = section.get("device") if isinstance(section, Mapping) else None
    if given not in (None, AUTO, device):
        raise ConfigError(
            f"{option}={device!r} contradicts the DeepSpeed config's "
            f"zero_optimization.{key}.device={given!r}; change one of them."
        )
    if device == "none":
        if section is None:
            return
        zero[key] = {**section, "device": "none"}
        return
    zero[key] = {**(section if isinstance(section, Mapping) else {}), "device": device}


def build_config(
    source: object, *, zero_stage: object = None, offload_optimizer: object = None,
    offload_params: object = None,
) -> dict[str, Any]:
    """The user's config with accel's shortcuts applied (they fill the config, or must agree).

    Args:
        source: a JSON path, a dict, or ``None`` (the shortcuts alone build the config).
        zero_stage: ``zero_optimization.stage`` (0-3).
        offload_optimizer: ``zero_optimization.offload_optimizer.device``.
        offload_params: ``zero_optimization.offload_param.device``.

    Raises:
        ConfigError: an invalid shortcut, or one that contradicts the config.

    Example:
        >>> build_config(None, zero_stage=3, offload_optimizer="cpu")["zero_optimization"]
        {'stage': 3, 'offload_optimizer': {'device': 'cpu'}}
    """
    config = load_config(source)
    zero_section = config.get("zero_optimization", {})
    if not isinstance(zero_section, Mapping):
        raise ConfigError(
            f"The DeepSpeed config's zero_optimization={zero_section!r} must be an object, "
            "e.g. `{\"stage\": 2}`."
        )
    zero = dict(zero_section)
    if zero_stage is not None:
        if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) or not (
            0 <= zero_stage <= 3
        ):
            raise ConfigError(
                f"zero_stage={zero_stage!r} is invalid; it must be 0, 1, 2 or 3, e.g. "
                "`accel.distributed(strategy='deepspeed', zero_stage=2)`."
            )
        given = zero.get("stage")
        if given not in (None, AUTO, zero_stage):
            raise ConfigError(
                f"zero_stage={zero_stage!r} contradicts the DeepSpeed config's "
                f"zero_optimization.stage={given!r}; change one of them."
            )
        zero["stage"] = zero_stage
    _offload(zero, "offload_optimizer", offload_optimizer, "offload_optimizer")
    _offload(zero, "offload_param", offload_params, "offload_params")
    if zero or "zero_optimization" in config:
        config["zero_optimization"] = zero
    return config


def _autos(value: object, path: str) -> Iterator[str]:
    if isinstance(value, str) and value.strip().lower() == AUTO:
        yield path
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _autos(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _autos(item, f"{path}[{index}]")


def _is_auto(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _number(config: Mapping[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None or _is_auto(value):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"The DeepSpeed config's {key}={value!r} must be a whole number >= 1 or \"auto\"."
        )
    return value


def _batch_sizes(config: dict[str, Any], facts: Facts) -> None:
    gas = facts.gradient_accumulation_steps
    given_gas = _number(config, "gradient_accumulation_steps")
    if given_gas is not None and given_gas != gas:
        raise ConfigError(
            f"The DeepSpeed config's gradient_accumulation_steps={given_gas} differs from "
            f"accel's gradient_accumulation_steps={gas} (accel.accumulate decides the sync "
            "steps). Set it once: `\"gradient_accumulation_steps\": \"auto\"` in the config "
            f"and `accel.distributed(gradient_accumulation_steps={given_gas})`."
        )
    config["gradient_accumulation_steps"] = gas
    micro = _number(config, "train_micro_batch_size_per_gpu")
    total = _number(config, "train_batch_size")
    per_step = gas * facts.world_size
    if micro is None:
        if facts.micro_batch is not None:
            micro = facts.micro_batch
        elif total is not None and total % per_step == 0:
            micro = total // per_step
        else:
            raise ConfigError(
                "The DeepSpeed config's train_micro_batch_size_per_gpu is \"auto\" (or "
                "missing) and accel cannot fill it: prepare the data loader with the model "
                "(`accel.prepare(model, optimizer, loader)`), or give the number in the config."
            )
    if total is not None and total != micro * per_step:
        raise ConfigError(
            f"The DeepSpeed config's train_batch_size={total} is not "
            f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({gas}) "
            f"x processes ({facts.world_size}) = {micro * per_step}; set it to \"auto\"."
        )
    config["train_micro_batch_size_per_gpu"] = micro
    config["train_batch_size"] = micro * per_step


def _precision(config: dict[str, Any], mode: str) -> None:
    if mode == "fp8":
        raise ConfigError(
            "mixed_precision='fp8' is not supported with strategy='deepspeed' (torchao's "
            "float8 layers need FSDP2). Use `mixed_precision='bf16'`, or `strategy='fsdp'`."
        )
    for key, wanted in (("bf16", mode == "bf16"), ("fp16", mode == "fp16")):
        section = config.get(key)
        if section is None:
            if wanted:
                config[key] = {"enabled": True}
            continue
        if not isinstance(section, Mapping):
            raise ConfigError(f"The DeepSpeed config's {key}={section!r} must be an object.")
        enabled = section.get("enabled", False)
        if _is_auto(enabled):
            enabled = wanted
        if bool(enabled) != wanted:
            raise ConfigError(
                f"The DeepSpeed config's {key}.enabled={section.get('enabled')!r} contradicts "
                f"mixed_precision={mode!r}; set it to \"auto\" (accel fills it from "
                f"mixed_precision), or run with `mixed_precision='{key if enabled else 'no'}'`."
            )
        config[key] = {**section, "enabled": bool(enabled)}


def _clipping(config: dict[str, Any], facts: Facts) -> bool:
    """Fill ``gradient_clipping``; whether the loop's first clip call sets it."""
    value = config.get("gradient_clipping")
    if value is None or _is_auto(value):
        if facts.gradient_clipping is not None:
            config["gradient_clipping"] = _clip_value(facts.gradient_clipping)
            return False
        config["gradient_clipping"] = 0.0
        return True
    config["gradient_clipping"] = _clip_value(value, "The DeepSpeed config's gradient_clipping")
    if facts.gradient_clipping is not None and facts.gradient_clipping != value:
        raise ConfigError(
            f"gradient_clipping={facts.gradient_clipping!r} (accel's option) contradicts the "
            f"DeepSpeed config's gradient_clipping={value!r}; set the config's to \"auto\"."
        )
    return False


def _clip_value(value: object, where: str = "gradient_clipping") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ConfigError(
            f"{where}={value!r} must be a number >= 0 (0: no clipping), e.g. "
            "`accel.distributed(strategy='deepspeed', gradient_clipping=1.0)`."
        )
    return float(value)


def _zero_sizes(config: dict[str, Any], hidden: int | None) -> None:
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or hidden is None:
        return
    sizes = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    for key, value in sizes.items():
        if _is_auto(zero.get(key)):
            zero[key] = value


def resolve_config(config: Mapping[str, Any], facts: Facts) -> Resolved:
    """Fill every ``"auto"`` from ``facts``; refuse contradictions and what stays ``"auto"``.

    Raises:
        ConfigError: a value that contradicts accel's settings, an ``"auto"`` accel cannot
            fill (the message names its key), or a client optimizer beside the config's.

    Example:
        >>> facts = Facts(mixed_precision="bf16", gradient_accumulation_steps=2, world_size=2,
        ...               micro_batch=4)
        >>> resolve_config({"train_batch_size": "auto"}, facts).config["train_batch_size"]
        16
    """
    out = copy.deepcopy(dict(config))
    _batch_sizes(out, facts)
    _precision(out, facts.mixed_precision)
    clip_from_loop = _clipping(out, facts)
    _zero_sizes(out, facts.hidden_size)
    if facts.client is not None:
        out = reconcile(out, facts.client)
    if facts.client_optimizer:
        if "optimizer" in out:
            raise ConfigError(
                "The DeepSpeed config has an \"optimizer\" section and the loop passes its own "
                "optimizer to accel.prepare; keep one: remove the section, or do not pass a "
                "torch optimizer (DeepSpeed then builds the config's)."
            )
        out.setdefault("zero_allow_untested_optimizer", True)
        zero = out.get("zero_optimization")
        offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
        if isinstance(offload, Mapping) and offload.get("device", "none") != "none":
            # a torch optimizer on the offloaded states (DeepSpeedCPUAdam needs a C++ build)
            out.setdefault("zero_force_ds_cpu_optimizer", False)
    left = list(_autos(out, ""))
    if left:
        raise ConfigError(
            f"The DeepSpeed config keeps \"auto\" at {left} and accel has nothing to fill "
            f"{'it' if len(left) == 1 else 'them'} with (it fills batch sizes, accumulation, "
            "bf16/fp16, gradient_clipping and, for a model with config.hidden_size, ZeRO "
            "bucket sizes). Write the value(s) in the config."
        )
    check_keys(out, world_size=facts.world_size)
    return Resolved(config=out, clip_from_loop=clip_from_loop)


def zero_stage(config: Mapping[str, Any]) -> object:
    """The config's ZeRO stage (``zero_optimization.stage``; ``None`` when it has none).

    Example:
        >>> zero_stage(build_config(None, zero_stage=3))
        3
    """
    zero = config.get("zero_optimization")
    return zero.get("stage") if isinstance(zero, Mapping) else None


def _without_autos(value: object) -> object:
    if isinstance(value, Mapping):
        return {k: _without_autos(v) for k, v in value.items() if not _is_auto(v)}
    if isinstance(value, list):
        return [_without_autos(v) for v in value if not _is_auto(v)]
    return value


def partition_config(config: Mapping[str, Any], facts: Facts) -> dict[str, Any]:
    """The config ``deepspeed.zero.Init`` gets while the model is built, before the loader
    and the model exist to fill the rest.

    ``zero.Init`` reads the precision (the partitions' dtype), the ZeRO section (parameter
    offload, persistence) and needs valid batch sizes: bf16/fp16 are filled from
    ``mixed_precision`` as for ``deepspeed.initialize`` (a contradiction is the same error),
    the batch sizes become a placeholder (micro batch 1 unless the config gives one; the
    loader gives the real one at ``accel.prepare``) and every other ``"auto"`` is left out
    (DeepSpeed's default; ``accel.prepare`` fills or refuses them as usual).

    Raises:
        ConfigError: ``mixed_precision`` contradicts the config's bf16/fp16, or is fp8.

    Example:
        >>> facts = Facts(mixed_precision="bf16", gradient_accumulation_steps=1, world_size=2)
        >>> partition_config({"zero_optimization": {"stage": 3}}, facts)["bf16"]
        {'enabled': True}
    """
    out = copy.deepcopy(dict(config))
    _precision(out, facts.mixed_precision)
    micro = out.get("train_micro_batch_size_per_gpu")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        out["train_micro_batch_size_per_gpu"] = 1
    out.pop("train_batch_size", None)  # DeepSpeed computes it from the other two
    out["gradient_accumulation_steps"] = facts.gradient_accumulation_steps
    stripped = _without_autos(out)
    assert isinstance(stripped, dict)
    check_keys(stripped, world_size=facts.world_size)
    return stripped

"""DDP options and communication hooks: validation, merging and registration.

The options are those of Accelerate's ``DistributedDataParallelKwargs``: five keywords of
:class:`~torch.nn.parallel.DistributedDataParallel` (``DDP_KEYWORDS``) and a communication
hook with its wrapper and state (``DDP_HOOK_KEYS``). They come from
``accel.distributed(**options)`` / the config file (``accel.state().options``) and from
``prepare_model(model, **strategy_options)``, which wins key by key. They are checked on every
world size (a bad value is the same error on 1 and N processes) and used only where a DDP
wrapper is made; elsewhere they are ignored, said once per block at debug level.

The option names, kinds and choices the config file can hold are defined with every other
setting in :mod:`accel.core.settings`; this module adds what only code can pass (a callable hook,
a state object). Importing it does not import torch.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from accel.core.once import first_time
from accel.core.setting_values import check_power_sgd_options
from accel.core.settings import (
    COMM_HOOKS,
    COMM_WRAPPERS,
    DDP_HOOK_KEYS,
    DDP_KEYWORDS,
    SETTINGS,
    did_you_mean,
)
from accel.errors import ConfigError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist  # noqa: F401  (in _bf16_compress_hook's type comment)
    from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "KNOWN_OPTIONS",
    "DDPOptions",
    "check_option",
    "ddp_options",
    "note_ignored",
    "make_ddp",
    "register_comm_hook",
]

KNOWN_OPTIONS = DDP_KEYWORDS + DDP_HOOK_KEYS
"""Every DDP option: the keywords and the hook (its names, kinds and choices are defined in
:mod:`accel.core.settings`)."""

_BOOLS = tuple(key for key in DDP_KEYWORDS if SETTINGS[key].kind == "bool")
_EXAMPLES = {
    "find_unused_parameters": "find_unused_parameters=True",
    "static_graph": "static_graph=True",
    "gradient_as_bucket_view": "gradient_as_bucket_view=True",
    "broadcast_buffers": "broadcast_buffers=False",
    "bucket_cap_mb": "bucket_cap_mb=50",
    "comm_hook": "comm_hook='fp16'",
    "comm_wrapper": "comm_hook='power_sgd', comm_wrapper='fp16'",
    "comm_state_option": "comm_state_option={'matrix_approximation_rank': 2}",
    "comm_state": "comm_hook=my_hook, comm_state=my_state",
}


def _invalid(key: str, value: object, expected: str, origin: str) -> ConfigError:
    return ConfigError(
        f"{origin}: DDP option {key}={value!r} is invalid; it must be {expected}, "
        f"e.g. `accel.prepare_model(model, {_EXAMPLES[key]})`."
    )


def check_option(key: str, value: object, origin: str = "accel.prepare_model") -> Any:
    """Check one DDP option and return it normalised (e.g. an enum hook name as ``str``).

    Args:
        key: a name in :data:`KNOWN_OPTIONS`.
        value: its value.
        origin: where it came from, for the error message.

    Returns:
        The value to use.

    Raises:
        ConfigError: unknown key or invalid value; the message names the key, the value and
            the expected form.

    Example:
        >>> check_option("comm_hook", "FP16")
        'fp16'
    """
    if key not in KNOWN_OPTIONS:
        raise _unknown(key, origin)
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise _invalid(key, value, "True or False", origin)
        return value
    if key == "bucket_cap_mb":
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise _invalid(key, value, "a number of megabytes > 0", origin)
        return value
    if key in ("comm_hook", "comm_wrapper"):
        choices = COMM_HOOKS if key == "comm_hook" else COMM_WRAPPERS
        if value is None:
            return "no"
        if isinstance(value, str):  # also Accelerate's DDPCommunicationHookType (a str enum)
            text = str(getattr(value, "value", value)).strip().lower()
            if text in choices:
                return text
        elif key == "comm_hook" and callable(value):
            return _check_hook_signature(value, origin)
        expected = f"one of {list(choices)}"
        if key == "comm_hook":
            expected += " or a callable `hook(state, bucket) -> torch.futures.Future`"
        raise _invalid(key, value, expected, origin)
    if key == "comm_state_option":
        return {} if value is None else check_power_sgd_options(value, origin)
    return value  # comm_state: any object, handed to the hook


def _check_hook_signature(hook: Callable[..., Any], origin: str) -> Callable[..., Any]:
    """DDP looks the hook's parameter ``bucket`` up by name and compares annotations as objects."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # no signature to read (some builtins): DDP decides
        return hook
    bucket = signature.parameters.get("bucket")
    problem = None
    if bucket is None or len(signature.parameters) != 2:
        problem = f"its parameters are {list(signature.parameters)}"
    elif isinstance(bucket.annotation, str) or isinstance(signature.return_annotation, str):
        problem = ("its annotations are strings (`from __future__ import annotations`), which "
                   "DDP rejects; leave them out")
    if problem is None:
        return hook
    raise ConfigError(
        f"{origin}: DDP option comm_hook={hook!r} cannot be registered: {problem}. A hook is "
        "`def hook(state, bucket): ...` returning a `torch.futures.Future` of the bucket's "
        "averaged tensor (the second parameter must be named `bucket`), e.g. "
        "`accel.prepare_model(model, comm_hook=my_hook, comm_state=my_state)`."
    )


def _unknown(key: str, origin: str) -> ConfigError:
    return ConfigError(
        f"{origin}: unknown DDP option {key!r}{did_you_mean(key, KNOWN_OPTIONS)}; the known "
        "ones are "
        f"{list(KNOWN_OPTIONS)}. Remove or rename it, e.g. "
        "`accel.prepare_model(model, find_unused_parameters=True)`."
    )


@attrs.frozen
class DDPOptions:
    """The merged, checked DDP options for one model.

    ``given`` names the options that were set (by ``prepare_model``, ``distributed()`` or
    the config file), in order; the other fields hold the values to use.
    """

    wrapper: Mapping[str, Any]
    comm_hook: str | Callable[..., Any] = "no"
    comm_wrapper: str = "no"
    comm_state_option: Mapping[str, Any] = attrs.field(factory=dict)
    comm_state: object = None
    given: tuple[str, ...] = ()


def ddp_options(run_options: Mapping[str, Any], given: Mapping[str, Any]) -> DDPOptions:
    """Merge the run's DDP options with ``prepare_model``'s (which win) and check them.

    Args:
        run_options: ``accel.state().options`` (from ``distributed()`` and the config file);
            keys that are not DDP options are left alone (they are other run-wide options).
        given: ``prepare_model``'s ``**strategy_options``; every key must be a DDP option.

    Returns:
        The checked options.

    Raises:
        ConfigError: an unknown key in ``given``, an invalid value, or ``comm_state`` with a
            hook that is not a callable.

    Example:
        >>> ddp_options({"comm_hook": "fp16"}, {"bucket_cap_mb": 50}).wrapper
        {'bucket_cap_mb': 50}
    """
    for key in given:
        if key not in KNOWN_OPTIONS:
            raise _unknown(key, "accel.prepare_model")
    merged: dict[str, Any] = {}
    for key in KNOWN_OPTIONS:
        if key in given:
            merged[key] = check_option(key, given[key], "accel.prepare_model")
        elif key in run_options:
            origin = "accel.distributed() or the config file"
            merged[key] = check_option(key, run_options[key], origin)
    hook = merged.get("comm_hook", "no")
    if merged.get("comm_state") is not None and not callable(hook):
        raise ConfigError(
            f"DDP option comm_state={merged['comm_state']!r} is the state of a hook you "
            f"write, but comm_hook={hook!r}. Pass your hook too "
            "(`accel.prepare_model(model, comm_hook=my_hook, comm_state=my_state)`), or use "
            "`comm_state_option={...}` to configure the built-in PowerSGD hooks."
        )
    wrapper = {key: merged[key] for key in DDP_KEYWORDS if key in merged}
    if wrapper.get("broadcast_buffers") is True:
        del wrapper["broadcast_buffers"]  # DDP's default; newer torch warns when it is passed
    return DDPOptions(
        wrapper=wrapper,
        comm_hook=hook,
        comm_wrapper=merged.get("comm_wrapper", "no"),
        comm_state_option=merged.get("comm_state_option", {}),
        comm_state=merged.get("comm_state"),
        given=tuple(merged),
    )


def note_ignored(options: DDPOptions, reason: str) -> None:
    """Say once per block, at debug level, that DDP options were set but no DDP wrapper applies.

    Example:
        >>> note_ignored(ddp_options({}, {"static_graph": True}), "world_size=1")
    """
    if not options.given or not first_time((__name__, "options ignored")):
        return
    from accel.comm.gating import get_logger

    get_logger(__name__, main_process_only=False).debug(
        "DDP options %s are ignored: no DDP wrapper applies (%s). They take effect where "
        "prepare_model wraps the model in DistributedDataParallel (several processes, "
        "strategy 'ddp', a trainable parameter, not evaluation_mode). Said once per block.",
        list(options.given), reason,
    )


def make_ddp(
    module: torch.nn.Module, options: DDPOptions, extra: Mapping[str, Any]
) -> DistributedDataParallel:
    """Wrap ``module`` in DDP with ``options`` (plus ``extra``, e.g. ``device_ids``) and hook.

    Example:
        >>> ddp = make_ddp(model, ddp_options({}, {"comm_hook": "fp16"}), {})
    """
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings():
        # accel documents broadcast_buffers (Accelerate's spelling); it is only passed when
        # False, which newer torch still honours but flags as deprecated.
        warnings.filterwarnings(
            "ignore", message=r"`broadcast_buffers` is deprecated", category=FutureWarning
        )
        model = DistributedDataParallel(module, **extra, **options.wrapper)
    register_comm_hook(model, options)
    return model


def register_comm_hook(model: DistributedDataParallel, options: DDPOptions) -> None:
    """Register ``options``' communication hook (wrapped as asked) on the DDP ``model``.

    The built-in hooks run on the default process group: ``"fp16"``/``"bf16"`` compress each
    bucket before the all-reduce, ``"power_sgd"``/``"batched_power_sgd"`` use a
    ``PowerSGDState`` built from ``comm_state_option``. A callable hook gets ``comm_state``.
    ``comm_wrapper`` wraps any hook; with ``comm_hook="no"`` nothing is registered.

    Raises:
        ConfigError: ``power_sgd`` without numpy, or PowerSGD refused the options.

    Example:
        >>> register_comm_hook(ddp, ddp_options({}, {"comm_hook": "power_sgd"}))
    """
    hook = options.comm_hook
    if hook == "no":
        return
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    native_bf16 = str(dist.get_backend()) in ("nccl", "xccl")
    state: object = None
    if callable(hook):
        chosen: Callable[..., Any] = hook
        state = options.comm_state
    elif hook in ("power_sgd", "batched_power_sgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        chosen = getattr(powerSGD_hook, "powerSGD_hook" if hook == "power_sgd"
                         else "batched_powerSGD_hook")
        state = _power_sgd_state(options.comm_state_option)
    elif hook == "fp16":
        chosen = default_hooks.fp16_compress_hook
    else:
        chosen = default_hooks.bf16_compress_hook if native_bf16 else _bf16_compress_hook
    if options.comm_wrapper == "fp16":
        chosen = default_hooks.fp16_compress_wrapper(chosen)
    elif options.comm_wrapper == "bf16":
        chosen = (default_hooks.bf16_compress_wrapper(chosen) if native_bf16
                  else _bf16_compress_wrapper(chosen))
    model.register_comm_hook(state=state, hook=chosen)


def _power_sgd_state(option: Mapping[str, Any]) -> object:
    try:
        import numpy  # noqa: F401  (PowerSGDState draws its seeds with numpy)
    except ImportError:
        raise ConfigError(
            "comm_hook='power_sgd' / 'batched_power_sgd' needs numpy (torch's PowerSGDState "
            "uses it), which is not installed. Install it (`pip install numpy`) or choose "
            "another hook, e.g. `comm_hook='fp16'`."
        ) from None
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    try:
        return powerSGD_hook.PowerSGDState(None, **option)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"PowerSGD refused comm_state_option={dict(option)!r} ({error}). Fix the options, "
            "e.g. `comm_state_option={'matrix_approximation_rank': 2}`."
        ) from None


# torch's bf16 hook and wrapper refuse to run without NCCL (old NCCL lacked bf16); gloo
# all-reduces bf16, so other backends get these equivalents. DDP checks a hook's annotations
# against objects, and this module's are strings (PEP 563), so the two hooks are typed with
# type comments: mypy reads them, and the hooks carry no annotations for DDP to refuse.
def _bf16_compress_hook(
    process_group,  # type: dist.ProcessGroup | None
    bucket,  # type: Any
):  # type: (...) -> torch.futures.Future[torch.Tensor]
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer: torch.Tensor = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    result: torch.futures.Future[torch.Tensor] = future.then(decompress)
    return result


def _bf16_compress_wrapper(
    hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]],
) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
    def bf16_wrapped_hook(
        hook_state,  # type: Any
        bucket,  # type: Any
    ):  # type: (...) -> torch.futures.Future[torch.Tensor]
        import torch

        original: torch.Tensor = bucket.buffer()
        bucket.set_buffer(original.to(torch.bfloat16))
        future = hook(hook_state, bucket)

        def decompress(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            original.copy_(done.value())
            return original

        return future.then(decompress)

    return bf16_wrapped_hook

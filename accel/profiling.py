"""``accel.profile``: ``torch.profiler`` with sensible activities and a trace per rank.

Accepts torch's own ``ProfilerActivity`` values and ``schedule`` callables, and Accelerate's
``ProfileKwargs`` forms: activities as strings (``"cpu"``, ``"cuda"``...) and a
``schedule_option`` dict.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from accel.core.state import state
from accel.errors import ConfigError

__all__ = ["profile", "trace_path"]

#: Activity names Accelerate's ``ProfileKwargs`` knows, in its order of mention.
ACTIVITY_NAMES = ("cpu", "cuda", "xpu", "mtia", "hpu")


def _device_available(name: str) -> bool:
    """Whether the accelerator behind activity ``name`` exists on this machine."""
    if name == "cpu":
        return True
    module = getattr(torch, name, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def _activities() -> list[ProfilerActivity]:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        activities.append(ProfilerActivity.XPU)
    return activities


def _resolve_activities(activities: Any) -> list[ProfilerActivity]:
    """Turn strings or ``ProfilerActivity`` values into the activities to profile.

    An activity whose device this machine lacks (``"cuda"`` without CUDA...) is dropped with
    a warning, as ``torch.profiler`` itself does for CUDA; if nothing is left, CPU is profiled.
    """
    if isinstance(activities, str | ProfilerActivity):
        activities = [activities]
    if not isinstance(activities, Iterable):
        raise ConfigError(
            f"profile(activities=...) must be a list of activity names or ProfilerActivity "
            f"values, got {activities!r}; e.g. activities=['cpu', 'cuda']."
        )
    resolved: list[ProfilerActivity] = []
    dropped: list[str] = []
    for item in activities:
        if isinstance(item, ProfilerActivity):
            activity, name = item, item.name.lower()
        elif isinstance(item, str):
            name = item.strip().lower()
            member = getattr(ProfilerActivity, name.upper(), None)
            if name not in ACTIVITY_NAMES or member is None:
                raise ConfigError(
                    f"Unknown profiler activity {item!r}; choose from {list(ACTIVITY_NAMES)} "
                    f"(any case) or pass torch.profiler.ProfilerActivity values."
                )
            activity = member
        else:
            raise ConfigError(
                f"profile(activities=...) items must be activity names or ProfilerActivity "
                f"values, got {item!r}; choose from {list(ACTIVITY_NAMES)}."
            )
        if name in ACTIVITY_NAMES and not _device_available(name):
            dropped.append(name)
        elif activity not in resolved:
            resolved.append(activity)
    if dropped:
        fallback = "" if resolved else "; profiling CPU only"
        warnings.warn(
            f"Profiler activities {dropped!r} requested but not available on this machine; "
            f"dropped{fallback}.",
            UserWarning,
            stacklevel=4,
        )
    return resolved or [ProfilerActivity.CPU]


def _schedule_from_option(option: Any) -> Callable[[int], Any]:
    """Build ``torch.profiler.schedule(**option)`` from Accelerate's ``schedule_option``."""
    if not isinstance(option, Mapping):
        raise ConfigError(
            f"profile(schedule_option=...) must be a dict, got {option!r}; "
            f"e.g. schedule_option={{'wait': 1, 'warmup': 1, 'active': 3}}."
        )
    parameters = inspect.signature(torch.profiler.schedule).parameters
    allowed = list(parameters)
    unknown = sorted(str(key) for key in option if key not in parameters)
    if unknown:
        raise ConfigError(
            f"Unknown schedule_option keys {unknown!r} in {dict(option)!r}; allowed keys: "
            f"{allowed}."
        )
    required = [n for n, p in parameters.items() if p.default is inspect.Parameter.empty]
    missing = [key for key in required if key not in option]
    if missing:
        raise ConfigError(
            f"schedule_option {dict(option)!r} is missing {missing!r}; give at least "
            f"{required}, e.g. {{'wait': 1, 'warmup': 1, 'active': 3}}."
        )
    for key, value in option.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"schedule_option[{key!r}] must be an int, got {value!r}.")
    try:
        schedule: Callable[[int], Any] = torch.profiler.schedule(**option)
    except AssertionError as error:
        raise ConfigError(
            f"Invalid schedule_option {dict(option)!r}: {error} Use wait, warmup, repeat, "
            f"skip_first >= 0 and active > 0."
        ) from None
    return schedule


def trace_path(
    output_trace_dir: str | os.PathLike[str], rank: int, step: int | None = None
) -> Path:
    """Where :func:`profile` writes a rank's Chrome trace.

    ``profile_<rank>.json``, or ``profile_<rank>_step<step>.json`` for each cycle of a
    ``schedule``.

    Example:
        >>> trace_path("traces", 1)
        PosixPath('traces/profile_1.json')
    """
    suffix = "" if step is None else f"_step{step}"
    return Path(output_trace_dir) / f"profile_{rank}{suffix}.json"


def _export_each_cycle(directory: Path, rank: int) -> Callable[[torch.profiler.profile], None]:
    def on_trace_ready(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(trace_path(directory, rank, prof.step_num)))

    return on_trace_ready


@contextmanager
def profile(
    *,
    output_trace_dir: str | os.PathLike[str] | None = None,
    schedule_option: Mapping[str, int] | None = None,
    **profiler_options: Any,
) -> Iterator[torch.profiler.profile]:
    """Profile the block with ``torch.profiler.profile`` on this rank; yield the profiler.

    Activities default to CPU plus CUDA (or XPU) when available. ``activities`` may be
    ``ProfilerActivity`` values or, as in Accelerate's ``ProfileKwargs``, names (``"cpu"``,
    ``"cuda"``, ``"xpu"``, ``"mtia"``, ``"hpu"``, any case); one whose device is missing on
    this machine is dropped with a warning (CPU is profiled if nothing is left). A
    ``schedule`` may be torch's callable or, as in Accelerate, a ``schedule_option`` dict
    (``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first``) for
    ``torch.profiler.schedule``. With ``output_trace_dir`` each rank writes its Chrome trace
    to ``output_trace_dir/profile_<rank>.json`` when the block ends (open it in
    ``chrome://tracing`` or Perfetto). With a schedule (and no ``on_trace_ready`` of your own),
    each finished cycle is written to ``profile_<rank>_step<N>.json``; call ``prof.step()``
    once per iteration. Not a collective: every rank profiles itself.

    Args:
        output_trace_dir: where to write the traces (created if missing); ``None``: none.
        schedule_option: keyword arguments for ``torch.profiler.schedule`` (not together
            with ``schedule``).
        **profiler_options: passed to ``torch.profiler.profile`` (``activities``,
            ``schedule``, ``on_trace_ready``, ``record_shapes``, ``profile_memory``,
            ``with_stack``, ``with_flops``, ``with_modules``...).

    Yields:
        The running ``torch.profiler.profile`` (``key_averages()`` after the block).

    Raises:
        ConfigError: an unknown activity name, bad ``schedule_option`` keys or values, or
            both ``schedule`` and ``schedule_option``.

    Example:
        >>> with accel.profile(activities=["cpu"], output_trace_dir="traces") as prof:
        ...     model(batch)
        >>> print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=5))
    """
    if profiler_options.get("activities") is None:
        profiler_options["activities"] = _activities()
    else:
        profiler_options["activities"] = _resolve_activities(profiler_options["activities"])
    if schedule_option is not None:
        if profiler_options.get("schedule") is not None:
            raise ConfigError(
                f"profile() got both schedule={profiler_options['schedule']!r} and "
                f"schedule_option={schedule_option!r}; pass only one of them."
            )
        profiler_options["schedule"] = _schedule_from_option(schedule_option)
    rank = state().rank
    directory = None if output_trace_dir is None else Path(output_trace_dir)
    scheduled = profiler_options.get("schedule") is not None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        if scheduled and profiler_options.get("on_trace_ready") is None:
            profiler_options["on_trace_ready"] = _export_each_cycle(directory, rank)
    with torch.profiler.profile(**profiler_options) as prof:
        yield prof
    if directory is not None and not scheduled:
        prof.export_chrome_trace(str(trace_path(directory, rank)))

"""``accel.profile``: ``torch.profiler`` with sensible activities and a trace per rank."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from accel._state import state

__all__ = ["profile", "trace_path"]


def _activities() -> list[ProfilerActivity]:
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        activities.append(ProfilerActivity.XPU)
    return activities


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
    *, output_trace_dir: str | os.PathLike[str] | None = None, **profiler_options: Any
) -> Iterator[torch.profiler.profile]:
    """Profile the block with ``torch.profiler.profile`` on this rank; yield the profiler.

    Activities default to CPU plus CUDA (or XPU) when available. With ``output_trace_dir``
    each rank writes its Chrome trace to ``output_trace_dir/profile_<rank>.json`` when the
    block ends (open it in ``chrome://tracing`` or Perfetto). With a ``schedule`` (and no
    ``on_trace_ready`` of your own), each finished cycle is written to
    ``profile_<rank>_step<N>.json``; call ``prof.step()`` once per iteration. Not a
    collective: every rank profiles itself.

    Args:
        output_trace_dir: where to write the traces (created if missing); ``None``: none.
        **profiler_options: passed to ``torch.profiler.profile`` (``activities``,
            ``schedule``, ``record_shapes``, ``profile_memory``, ``with_stack``...).

    Yields:
        The running ``torch.profiler.profile`` (``key_averages()`` after the block).

    Example:
        >>> with accel.profile(output_trace_dir="traces", record_shapes=True) as prof:
        ...     model(batch)
        >>> print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=5))
    """
    profiler_options.setdefault("activities", _activities())
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

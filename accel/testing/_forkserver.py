"""The warm fork server that the processes of ``accel.testing``'s runs fork from.

:func:`context` is the multiprocessing context of ``run_distributed``, ``run_script`` and
``start_script``: a fork server that has torch and accel imported (~0.1 s a process instead of
~2 s for a fresh interpreter), or ``spawn`` where there is no fork server. The server imports
:data:`PRELOAD` and what :func:`add_preload` added (``accel.testing.preload``), with
``accel.testing._warm_server`` last: it freezes what the others imported.

Example:
    >>> ctx = context()
    >>> proc = ctx.Process(target=print, args=("hello",))
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterable
from typing import Any

from accel.errors import ConfigError

# What the server imports once, before it forks workers: torch, torch._dynamo (which torch
# imports on first use of an optimizer or of torch.compile: seconds in every fresh process),
# FSDP and distributed checkpoints, accel and run_script's entry point; accel.testing._warm_server,
# last, imports accel's public modules and freezes all of it.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "accel.testing", "accel.launch.worker",
           "accel.testing._warm_server")
_EXTRA: list[str] = []  # accel.testing.preload()'s modules
_STARTED = [False]  # whether a run has asked for the server in this process


def add_preload(modules: Iterable[str]) -> None:
    """Have the server also import ``modules`` (checked importable by the caller).

    Raises:
        ConfigError: the server is in use already, so it would not import them.
    """
    modules = tuple(modules)
    if _STARTED[0]:
        raise ConfigError(
            f"preload{modules!r} comes after the warm server started in this process, so it "
            "would not import them. Call preload() before the first run_distributed / "
            "run_script (e.g. at the top of conftest.py)."
        )
    _EXTRA.extend(m for m in modules if m not in _EXTRA)


def context() -> Any:
    """The fork server context (``spawn`` where the platform has no fork server)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD[:-1], *_EXTRA, PRELOAD[-1]])
        _STARTED[0] = True
        return ctx
    return mp.get_context("spawn")

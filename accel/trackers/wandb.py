"""The ``wandb`` tracker (extra ``accel[wandb]``): a Weights & Biases run, online or offline.

``wandb.init`` gets ``project`` (default: the name of ``project_dir``), ``name`` (the run
name), ``dir`` (the run directory) and ``config``; ``init_kwargs={"wandb": {...}}`` adds or
overrides options, e.g. ``{"wandb": {"mode": "offline", "entity": "team"}}``. Without a
``mode`` option, wandb's own settings apply (``WANDB_MODE=offline`` works), except when wandb
was not named but picked by ``log_with="all"``: then the run is offline (files under the run
directory, nothing sent, no login asked) unless ``WANDB_MODE`` is set or ``init_kwargs`` gives
a ``mode``, e.g. ``{"wandb": {"mode": "online"}}``. A run whose block raised is finished with
exit code 1.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from accel.core.env import read_variable
from accel.trackers.base import LogValue, RunInfo

__all__ = ["WandbTracker", "start"]


class WandbTracker:
    """Logs to a ``wandb`` run; ``accel.get_tracker("wandb")`` returns the run.

    Example:
        >>> run = accel.get_tracker("wandb")
        >>> run.summary["best_accuracy"] = 0.93
    """

    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run
        self.closed = False
        self._exit_code = 0

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """``run.log(values, step=step)`` (``None``: wandb's own step counter)."""
        self.run.log(dict(values), step=step)

    def on_error(self, exc: BaseException) -> None:
        """Mark the run failed (exit code 1) before it is finished."""
        self._exit_code = 1

    def finish(self) -> None:
        """Finish the run (uploads or, offline, closes the local files)."""
        if not self.closed:
            self.closed = True
            self.run.finish(exit_code=self._exit_code)

    @property
    def native(self) -> Any:
        """The ``wandb`` run object."""
        return self.run


def start(run: RunInfo) -> WandbTracker:
    """``wandb.init`` a run for ``run`` (project, name, directory and config filled in)."""
    wandb = importlib.import_module("wandb")
    options: dict[str, Any] = {
        "project": run.project_dir.name or "accel",
        "name": run.run_name,
        "dir": str(run.run_dir),
        **run.options,
    }
    if run.picked_by_all and "mode" not in options and read_variable("WANDB_MODE") is None:
        options["mode"] = "offline"  # "all" asked for every tracker, not for an upload
    if run.config:
        options["config"] = {**dict(run.config), **dict(options.get("config") or {})}
    return WandbTracker(wandb.init(**options))

"""The ``swanlab`` tracker (extra ``accel[swanlab]``): a SwanLab run, offline by default.

Unless a mode is chosen, the run is ``mode="offline"``: SwanLab writes it under the run
directory (``project_dir/<run_name>/run-<time>-<id>/``, with its ``.swanlab`` record file) and
sends nothing, asks for no login; ``swanlab sync <that folder>`` uploads it later. Choose a
mode with ``init_kwargs={"swanlab": {"mode": "online"}}`` (or ``"local"``, ``"disabled"``) or
SwanLab's own ``SWANLAB_MODE``. The project is the name of ``project_dir``, the experiment's
name the run name; the other ``init_kwargs`` go to ``swanlab.init``. Numbers are logged as
scalars, strings as ``swanlab.Text``, the config as the run's config. A run whose block raised
finishes with the state ``crashed``.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping
from typing import Any

from accel.core.env import read_variable
from accel.trackers.base import LogValue, RunInfo

__all__ = ["SwanLabTracker", "start"]


class SwanLabTracker:
    """Logs to a SwanLab run; ``accel.get_tracker("swanlab")`` returns the run.

    Example:
        >>> run = accel.get_tracker("swanlab")
        >>> run.log({"sample": swanlab.Image(picture)}, step=step)
    """

    name = "swanlab"

    def __init__(self, run: Any, swanlab: Any) -> None:
        self.run = run
        self._swanlab = swanlab
        self._error: str | None = None
        self.closed = False

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """``run.log`` at ``step`` (``None``: SwanLab's own); strings as ``swanlab.Text``."""
        data = {
            key: self._swanlab.Text(value) if isinstance(value, str) else value
            for key, value in values.items()
        }
        self.run.log(data, step=step)

    def on_error(self, exc: BaseException) -> None:
        """Finish the run as ``crashed`` (with the error as its message)."""
        self._error = f"{exc!r:.500}"

    def finish(self) -> None:
        """Finish the run (``success``, or ``crashed`` after an error)."""
        if self.closed:
            return
        self.closed = True
        if self._error is None:
            self.run.finish()
        else:
            self.run.finish(state="crashed", error=self._error)

    @property
    def native(self) -> Any:
        """The SwanLab run."""
        return self.run


def start(run: RunInfo) -> SwanLabTracker:
    """``swanlab.init`` a run in ``run.run_dir`` (offline unless a mode is chosen)."""
    swanlab = importlib.import_module("swanlab")
    accepted = inspect.signature(swanlab.init).parameters  # the names changed in SwanLab 0.7
    options: dict[str, Any] = {
        "project": run.project_dir.resolve().name or "accel",
        "name" if "name" in accepted else "experiment_name": run.run_name,
        "log_dir" if "log_dir" in accepted else "logdir": str(run.run_dir),
        **run.options,
    }
    if "mode" not in options and read_variable("SWANLAB_MODE") is None:
        options["mode"] = "offline"  # offline unless the user chose a mode
    if run.config:
        plain = json.loads(json.dumps(dict(run.config), default=str))
        options["config"] = {**plain, **dict(options.get("config") or {})}
    return SwanLabTracker(swanlab.init(**options), swanlab)

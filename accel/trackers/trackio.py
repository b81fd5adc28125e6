"""The ``trackio`` tracker (extra ``accel[trackio]``): a run in trackio's local store.

trackio keeps every project in its own local SQLite store, ``TRACKIO_DIR`` (by default
``~/.cache/huggingface/trackio``), not in the run directory: ``trackio show --project
<name of project_dir>`` opens it. The project is the name of ``project_dir`` and the run is
named after the run name; reusing a run name continues that run (``resume="allow"``). Nothing
is sent unless you name a Space or server: ``init_kwargs={"trackio": {"space_id":
"user/space"}}`` (or trackio's own ``TRACKIO_SPACE_ID``). Numbers and strings are logged as
they are, the config is the run's config. A run whose block raised gets an ``ERROR`` alert
before it finishes. Other ``init_kwargs={"trackio": {...}}`` go to ``trackio.init``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from accel.trackers.base import LogValue, RunInfo

__all__ = ["TrackioTracker", "start"]


class TrackioTracker:
    """Logs to a trackio run; ``accel.get_tracker("trackio")`` returns the run.

    Example:
        >>> run = accel.get_tracker("trackio")
        >>> run.log({"samples": trackio.Table(dataframe=table)}, step=step)
    """

    name = "trackio"

    def __init__(self, run: Any, trackio: Any) -> None:
        self.run = run
        self._trackio = trackio
        self.closed = False

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """``run.log(values, step=step)`` (``None``: trackio's own counter)."""
        self.run.log(dict(values), step=step)

    def on_error(self, exc: BaseException) -> None:
        """Raise an ``ERROR`` alert on the run (trackio has no failed status)."""
        alert = getattr(self.run, "alert", None)
        level = getattr(getattr(self._trackio, "AlertLevel", None), "ERROR", None)
        if callable(alert) and level is not None:
            alert(title="the tracking block raised", text=f"{exc!r:.500}", level=level)

    def finish(self) -> None:
        """``run.finish()``: flush the run to the local store."""
        if not self.closed:
            self.closed = True
            self.run.finish()

    @property
    def native(self) -> Any:
        """The trackio run."""
        return self.run


def start(run: RunInfo) -> TrackioTracker:
    """``trackio.init`` a run named ``run.run_name`` and record the config."""
    trackio = importlib.import_module("trackio")
    options: dict[str, Any] = {
        "project": run.project_dir.resolve().name or "accel",
        "name": run.run_name,
        "resume": "allow",
        "embed": False,
        **run.options,
    }
    if run.config:
        plain = json.loads(json.dumps(dict(run.config), default=str))
        options["config"] = {**plain, **dict(options.get("config") or {})}
    return TrackioTracker(trackio.init(**options), trackio)

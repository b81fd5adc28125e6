"""The ``dvclive`` tracker (extra ``accel[dvclive]``): DVCLive's files in the run directory.

``dvclive.Live`` writes to ``project_dir/<run_name>/``: ``metrics.json`` (the latest values),
``plots/metrics/<name>.tsv`` (one row per step), ``params.yaml`` (the config) and a
``dvc.yaml`` describing them (``dvc plots show project_dir/<run_name>/dvc.yaml``). Numbers and
strings are logged with ``log_metric``; each ``accel.log`` call is one DVCLive step (its
``step``, or DVCLive's own counter when ``None``). No DVC experiment is saved (pass
``{"dvclive": {"save_dvc_exp": True}}`` inside a DVC repository for one), and reusing a run
name resumes its files instead of clearing them (``{"dvclive": {"resume": False}}`` clears).
Nothing leaves the machine unless you configured a DVC Studio token (``DVC_STUDIO_TOKEN`` or
DVC's ``studio.token``), which DVCLive then posts live updates with; ``DVC_STUDIO_OFFLINE=1``
turns that off. Note that DVCLive itself runs ``dvc init`` (and stages ``.dvc/`` and
``.dvcignore`` with git) when the working directory is inside a Git repository that is not a
DVC repository yet; if that is unwanted, start the script from a directory outside it.
Other ``init_kwargs={"dvclive": {...}}`` go to ``Live``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from accel.trackers.base import LogValue, RunInfo

__all__ = ["DVCLiveTracker", "start"]


class DVCLiveTracker:
    """Logs through a ``dvclive.Live``; ``accel.get_tracker("dvclive")`` returns it.

    Example:
        >>> live = accel.get_tracker("dvclive")
        >>> live.log_artifact("model.safetensors", type="model")
    """

    name = "dvclive"

    def __init__(self, live: Any) -> None:
        self.live = live
        self.closed = False

    def store_config(self, config: Mapping[str, Any]) -> None:
        """``log_params`` into ``params.yaml`` (values that are not JSON as text)."""
        self.live.log_params(json.loads(json.dumps(dict(config), default=str)))

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """One DVCLive step: ``log_metric`` each value, then ``next_step``."""
        if step is not None:
            self.live.step = step
        for key, value in values.items():
            self.live.log_metric(key, value)
        self.live.next_step()

    def finish(self) -> None:
        """``Live.end()``: write the summary and ``dvc.yaml``."""
        if not self.closed:
            self.closed = True
            self.live.end()

    @property
    def native(self) -> Any:
        """The ``dvclive.Live``."""
        return self.live


def start(run: RunInfo) -> DVCLiveTracker:
    """Open a ``dvclive.Live`` on ``run.run_dir`` and record the config."""
    dvclive = importlib.import_module("dvclive")
    options: dict[str, Any] = {
        "dir": str(run.run_dir),
        "resume": True,
        "save_dvc_exp": False,
        "dvcyaml": str(run.run_dir / "dvc.yaml"),
        **run.options,
    }
    tracker = DVCLiveTracker(dvclive.Live(**options))
    if run.config:
        tracker.store_config(run.config)
    return tracker

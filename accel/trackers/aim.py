"""The ``aim`` tracker (extra ``accel[aim]``): an Aim run in a local Aim repository.

The repository is ``project_dir`` (Aim keeps it in ``project_dir/.aim``; view it with
``aim up --repo project_dir``), the run's ``experiment`` is the name of ``project_dir`` and its
``name`` the run name. Numbers are tracked as metrics, strings as ``aim.Text`` sequences, the
config as the run's ``hparams``. ``init_kwargs={"aim": {...}}`` is passed to ``aim.Run``, e.g.
``{"aim": {"repo": "aim://host:53800", "system_tracking_interval": None}}``; only a remote
``repo`` you give sends anything over the network. When the run ends it is indexed at once, so
``aim.Repo(project_dir)`` lists it without a running ``aim up``. A run whose block raised gets
an error log record and no successful-finish report (Aim's check-ins count it as failed).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from accel.trackers.base import LogValue, RunInfo

__all__ = ["AimTracker", "start"]


class AimTracker:
    """Tracks values on an ``aim.Run``; ``accel.get_tracker("aim")`` returns the run.

    Example:
        >>> run = accel.get_tracker("aim")
        >>> run.track(aim.Distribution(weights), name="weights", step=step)
    """

    name = "aim"

    def __init__(self, run: Any, aim: Any) -> None:
        self.run = run
        self._aim = aim
        self._failed: BaseException | None = None
        self.closed = False

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Record the config as the run's ``hparams`` (values that are not JSON as text)."""
        self.run["hparams"] = json.loads(json.dumps(dict(config), default=str))

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """``run.track`` each value (strings as ``aim.Text``) at ``step`` (``None``: Aim's own)."""
        for key, value in values.items():
            tracked = self._aim.Text(value) if isinstance(value, str) else value
            self.run.track(tracked, name=key, step=step)

    def on_error(self, exc: BaseException) -> None:
        """Remember the failure: it is logged on the run and no successful finish reported."""
        self._failed = exc

    def finish(self) -> None:
        """Report the finish (or log the error), close the run and index it in the repo."""
        if self.closed:
            return
        self.closed = True
        run_hash, repo = self.run.hash, self.run.repo
        if self._failed is None:
            self.run.report_successful_finish()
        else:
            self.run.log_error(f"the tracking block raised {self._failed!r:.500}")
        self.run.close()
        _index(repo, run_hash)

    @property
    def native(self) -> Any:
        """The ``aim.Run``."""
        return self.run


def _index(repo: Any, run_hash: str) -> None:
    """Index the closed run, so that ``aim.Repo`` readers see it without ``aim up`` running."""
    if getattr(repo, "is_remote_repo", False):
        return  # the remote server indexes its own runs
    try:
        manager = importlib.import_module("aim.sdk.index_manager").RepoIndexManager
    except (ImportError, AttributeError):
        return  # an Aim without an index (older than 3.19) reads the run's own files
    manager.get_index_manager(repo).index(run_hash)


def start(run: RunInfo) -> AimTracker:
    """Open an ``aim.Run`` in the repository ``project_dir`` and record the config."""
    aim = importlib.import_module("aim")
    options: dict[str, Any] = {
        "repo": str(run.project_dir),
        "experiment": run.project_dir.resolve().name or "accel",
        **run.options,
    }
    tracker = AimTracker(aim.Run(**options), aim)
    tracker.run.name = run.run_name
    if run.config:
        tracker.store_config(run.config)
    return tracker

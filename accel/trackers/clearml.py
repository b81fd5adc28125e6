"""The ``clearml`` tracker (extra ``accel[clearml]``): a ClearML task, in offline mode by default.

Unless you ask for online, ``Task.set_offline(True)`` is set before ``Task.init``: nothing is
sent and no server or credentials are needed. ClearML keeps the offline session in its cache
(``<cache>/offline/<task id>/`` and, after the run, a ``.zip`` of it; the cache is
``CLEARML_CACHE_DIR`` or ``sdk.storage.cache.default_base_dir``, by default
``~/.clearml/cache``); ``accel.get_tracker("clearml").get_offline_mode_folder()`` names it,
and ``Task.import_offline_session(zip)`` uploads it later. Online:
``init_kwargs={"clearml": {"offline": False}}`` (your ClearML configuration), or ClearML's own
``CLEARML_OFFLINE_MODE``. The project is the name of ``project_dir``, the task name the run
name; the other ``init_kwargs`` go to ``Task.init``, e.g.
``{"clearml": {"auto_connect_frameworks": False, "tags": ["sweep"]}}``. Numbers are reported
as scalars (title and series: the key), strings as text reports (``key: value``), the config
with ``connect_configuration`` (named ``config``). A task whose block raised is marked failed
(ClearML stores no status in an offline session). ClearML's offline setting is process-wide and
stays on after the block (switching back online connects to the server); it runs one task per
process, so ``clearml`` blocks do not nest.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from accel.trackers.base import LogValue, RunInfo

__all__ = ["ClearMLTracker", "start"]


class ClearMLTracker:
    """Reports to a ClearML ``Task``; ``accel.get_tracker("clearml")`` returns the task.

    Example:
        >>> task = accel.get_tracker("clearml")
        >>> task.get_logger().report_histogram("weights", "w", values, iteration=step)
    """

    name = "clearml"

    def __init__(self, task: Any) -> None:
        self.task = task
        self._calls = 0
        self.closed = False

    def store_config(self, config: Mapping[str, Any]) -> None:
        """``connect_configuration`` named ``config`` (values that are not JSON as text)."""
        plain = json.loads(json.dumps(dict(config), default=str))
        self.task.connect_configuration(plain, name="config")

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """Scalars with ``report_scalar``, strings with ``report_text``, at ``step``
        (``None``: counts calls)."""
        at = self._calls if step is None else step
        self._calls += 1
        logger = self.task.get_logger()
        for key, value in values.items():
            if isinstance(value, str):
                logger.report_text(f"{key}: {value}", iteration=at)
            else:
                logger.report_scalar(title=key, series=key, value=value, iteration=at)

    def on_error(self, exc: BaseException) -> None:
        """Mark the task failed with the error as its reason."""
        self.task.mark_failed(status_reason=f"{exc!r:.500}", force=True)

    def finish(self) -> None:
        """Close the task (offline: zip its session folder)."""
        if not self.closed:
            self.closed = True
            self.task.close()

    @property
    def native(self) -> Any:
        """The ClearML ``Task``."""
        return self.task


def start(run: RunInfo) -> ClearMLTracker:
    """``Task.init`` a task (offline unless ``offline=False``) and record the config."""
    task_class = importlib.import_module("clearml").Task
    options = dict(run.options)
    if options.pop("offline", True):
        task_class.set_offline(offline_mode=True)
    options.setdefault("project_name", run.project_dir.resolve().name or "accel")
    options.setdefault("task_name", run.run_name)
    options.setdefault("reuse_last_task_id", False)
    tracker = ClearMLTracker(task_class.init(**options))
    if run.config:
        tracker.store_config(run.config)
    return tracker

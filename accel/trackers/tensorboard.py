"""The ``tensorboard`` tracker (extra ``accel[tensorboard]``): event files in the run directory.

Numbers go to ``add_scalar``, strings to ``add_text``, the config to a ``config`` text entry.
Event files land in ``project_dir/<run_name>/``, so ``tensorboard --logdir project_dir`` shows
one run per name. ``init_kwargs={"tensorboard": {...}}`` is passed to ``SummaryWriter``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from accel.trackers.base import LogValue, RunInfo

__all__ = ["TensorBoardTracker", "start"]


class TensorBoardTracker:
    """Writes values with ``torch.utils.tensorboard.SummaryWriter``.

    ``accel.get_tracker("tensorboard")`` returns the ``SummaryWriter``.

    Example:
        >>> writer = accel.get_tracker("tensorboard")
        >>> writer.add_histogram("weights", model.weight, step)
    """

    name = "tensorboard"

    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self._calls = 0
        self.closed = False

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Record the config as a JSON text entry named ``config``."""
        text = json.dumps(dict(config), indent=2, default=str)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """Scalars with ``add_scalar``, strings with ``add_text``; ``None`` step counts calls."""
        at = self._calls if step is None else step
        self._calls += 1
        for key, value in values.items():
            if isinstance(value, str):
                self.writer.add_text(key, value, at)
            else:
                self.writer.add_scalar(key, value, at)

    def finish(self) -> None:
        """Flush and close the event file."""
        if not self.closed:
            self.writer.flush()
            self.writer.close()
            self.closed = True

    @property
    def native(self) -> Any:
        """The ``SummaryWriter``."""
        return self.writer


def start(run: RunInfo) -> TensorBoardTracker:
    """Open a ``SummaryWriter`` on ``run.run_dir`` and record the config."""
    module = importlib.import_module("torch.utils.tensorboard")
    options = dict(run.options)
    options.setdefault("log_dir", str(run.run_dir))
    tracker = TensorBoardTracker(module.SummaryWriter(**options))
    if run.config:
        tracker.store_config(run.config)
    return tracker

"""The ``comet_ml`` tracker (extra ``accel[comet_ml]``): a Comet experiment, offline by default.

Unless you ask for online, the experiment is a ``comet_ml.OfflineExperiment`` writing its
archive (``<experiment key>.zip``) into the run directory: nothing is sent and no API key is
needed (offline, Comet's environment details are off by default, since collecting them
looks up the public IP address and cloud metadata over the network;
``{"comet_ml": {"log_env_details": True}}`` turns them on). Upload the archive later with
``comet upload project_dir/<run_name>/*.zip``. Online:
``init_kwargs={"comet_ml": {"online": True}}`` starts a ``comet_ml.Experiment`` (your API key
and workspace from Comet's own configuration). The project is the name of ``project_dir``,
the experiment's name the run name. The other ``init_kwargs`` go to the experiment, e.g.
``{"comet_ml": {"workspace": "team", "log_code": False}}``. Numbers are logged with
``log_metrics``, strings with ``log_other`` (the latest value per key), the config with
``log_parameters``. Comet keeps no run status; a block that raised logs the error as the
``accel_error`` "other" value before the experiment ends.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

from accel.trackers.base import LogValue, RunInfo

__all__ = ["CometTracker", "start"]


class CometTracker:
    """Logs to a Comet experiment; ``accel.get_tracker("comet_ml")`` returns the experiment.

    Example:
        >>> experiment = accel.get_tracker("comet_ml")
        >>> experiment.log_confusion_matrix(labels, predictions)
    """

    name = "comet_ml"

    def __init__(self, experiment: Any) -> None:
        self.experiment = experiment
        self.closed = False

    def store_config(self, config: Mapping[str, Any]) -> None:
        """``log_parameters`` (values that are not JSON as text; nested dicts flattened)."""
        self.experiment.log_parameters(json.loads(json.dumps(dict(config), default=str)))

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """Numbers with ``log_metrics`` at ``step`` (``None``: Comet's own), strings with
        ``log_other``."""
        numbers = {k: v for k, v in values.items() if not isinstance(v, str)}
        if numbers:
            self.experiment.log_metrics(numbers, step=step)
        for key, value in values.items():
            if isinstance(value, str):
                self.experiment.log_other(key, value)

    def on_error(self, exc: BaseException) -> None:
        """Log the error as the ``accel_error`` value (Comet has no failed status to set)."""
        self.experiment.log_other("accel_error", f"{exc!r:.500}")

    def finish(self) -> None:
        """End the experiment (offline: write its archive into the run directory)."""
        if not self.closed:
            self.closed = True
            self.experiment.end()

    @property
    def native(self) -> Any:
        """The ``comet_ml`` experiment (``OfflineExperiment`` unless online was asked for)."""
        return self.experiment


def start(run: RunInfo) -> CometTracker:
    """Create the experiment (offline into ``run.run_dir`` unless ``online=True``)."""
    comet_ml = importlib.import_module("comet_ml")
    options = dict(run.options)
    online = bool(options.pop("online", False))
    options.setdefault("project_name", run.project_dir.resolve().name or "accel")
    if online:
        experiment = comet_ml.Experiment(**options)
    else:
        options.setdefault("offline_directory", str(run.run_dir))
        # Comet's environment details look up the public IP (comet.com) and cloud metadata
        options.setdefault("log_env_details", False)
        experiment = comet_ml.OfflineExperiment(**options)
    experiment.set_name(run.run_name)
    tracker = CometTracker(experiment)
    if run.config:
        tracker.store_config(run.config)
    return tracker

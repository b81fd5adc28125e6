"""The ``mlflow`` tracker (extra ``accel[mlflow]``): an MLflow run in a local or remote store.

The store is, in order: ``init_kwargs={"mlflow": {"tracking_uri": ...}}``, the URI MLflow is
configured with (``MLFLOW_TRACKING_URI`` or ``mlflow.set_tracking_uri``), else a local
``sqlite:///<project_dir>/mlflow.db``. New experiments keep artifacts under
``project_dir/mlartifacts``. The experiment is ``experiment_name``, else
``MLFLOW_EXPERIMENT_NAME``, else the name of ``project_dir``. Options in
``init_kwargs={"mlflow": {...}}``: ``tracking_uri``, ``experiment_name``, ``tags``,
``artifact_location``. The adapter uses an ``MlflowClient`` (no process-wide MLflow state is
changed). Numbers are logged as metrics, strings as tags, the config as params. A run whose
block raised ends with status ``FAILED``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from typing import Any

from accel.errors import ArgumentTypeError
from accel.trackers.base import LogValue, RunInfo

__all__ = ["MlflowTracker", "start"]

_BATCH = 100  # MLflow's limit on params per log_batch call
_PARAM_CHARS = 6000  # MLflow's limit on a param value's length


class MlflowTracker:
    """Logs to one MLflow run through an ``MlflowClient``.

    ``accel.get_tracker("mlflow")`` returns this object: use ``.client`` and ``.run_id``.

    Example:
        >>> tracker = accel.get_tracker("mlflow")
        >>> tracker.client.log_artifact(tracker.run_id, "model.safetensors")
    """

    name = "mlflow"

    def __init__(self, client: Any, run_id: str, entities: Any) -> None:
        self.client = client
        self.run_id = run_id
        self._entities = entities
        self._status = "FINISHED"
        self._calls = 0
        self.closed = False

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Log the config as params (values as text, cut to MLflow's length limit)."""
        params = [
            self._entities.Param(str(k), str(v)[:_PARAM_CHARS]) for k, v in config.items()
        ]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """Numbers as metrics at ``step`` (``None``: counts calls), strings as tags."""
        at = self._calls if step is None else step
        self._calls += 1
        now = int(time.time() * 1000)
        metrics = [
            self._entities.Metric(k, float(v), now, at)
            for k, v in values.items()
            if not isinstance(v, str)
        ]
        tags = [self._entities.RunTag(k, v) for k, v in values.items() if isinstance(v, str)]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def on_error(self, exc: BaseException) -> None:
        """End the run as ``FAILED``."""
        self._status = "FAILED"

    def finish(self) -> None:
        """Mark the run terminated (``FINISHED``, or ``FAILED`` after an error)."""
        if not self.closed:
            self.closed = True
            self.client.set_terminated(self.run_id, status=self._status)

    @property
    def native(self) -> MlflowTracker:
        """The tracker itself (``client`` and ``run_id``)."""
        return self


def _configured(variable: str) -> str | None:
    """An MLflow setting from MLflow's own environment variables (read by MLflow)."""
    settings = importlib.import_module("mlflow.environment_variables")
    value = getattr(settings, variable, None)
    return None if value is None else value.get()


def _configured_uri(mlflow: Any) -> str | None:
    """The tracking URI the user configured for MLflow, or ``None`` for MLflow's default."""
    utils = importlib.import_module("mlflow.tracking._tracking_service.utils")
    is_set = getattr(utils, "is_tracking_uri_set", None)
    if callable(is_set):
        return str(mlflow.get_tracking_uri()) if is_set() else None
    return _configured("MLFLOW_TRACKING_URI")


def start(run: RunInfo) -> MlflowTracker:
    """Create (or reuse) the experiment and start a run in it."""
    mlflow = importlib.import_module("mlflow")
    entities = importlib.import_module("mlflow.entities")
    options = dict(run.options)
    project = run.project_dir.resolve()
    uri = options.pop("tracking_uri", None) or _configured_uri(mlflow)
    uri = uri or f"sqlite:///{project / 'mlflow.db'}"
    experiment_name = (
        options.pop("experiment_name", None)
        or _configured("MLFLOW_EXPERIMENT_NAME")
        or project.name
        or "accel"
    )
    artifacts = options.pop("artifact_location", None) or (project / "mlartifacts").as_uri()
    tags = dict(options.pop("tags", None) or {})
    if options:
        raise ArgumentTypeError(
            f"Unknown mlflow init options {sorted(options)!r}; the mlflow tracker takes "
            "'tracking_uri', 'experiment_name', 'tags' and 'artifact_location'."
        )
    project.mkdir(parents=True, exist_ok=True)
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        experiment_id = client.create_experiment(experiment_name, artifact_location=artifacts)
    else:
        experiment_id = experiment.experiment_id
    mlrun = client.create_run(experiment_id, run_name=run.run_name, tags=tags)
    tracker = MlflowTracker(client, mlrun.info.run_id, entities)
    if run.config:
        tracker.store_config(run.config)
    return tracker

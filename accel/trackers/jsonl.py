"""The built-in ``jsonl`` tracker: no dependency, one JSON object per ``accel.log`` call.

Layout: ``project_dir/<run_name>/metrics.jsonl`` (rows ``{"step": ..., "time": ..., **values}``,
``time`` being the wall-clock time in seconds since the epoch) and ``config.json``. Rows are
appended and flushed at every call, so a killed run keeps what it logged; reusing a run name
appends to the same file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from accel.errors import ArgumentTypeError, LogValueError
from accel.trackers.base import LogValue, RunInfo

__all__ = ["JsonlTracker", "read_jsonl", "start"]

RESERVED_KEYS = ("step", "time")


class JsonlTracker:
    """Appends one JSON line per ``log`` call to ``run_dir/metrics.jsonl``.

    Attributes:
        path: the ``metrics.jsonl`` file.
        config_path: the ``config.json`` file (written when a config is given).

    Example:
        >>> tracker = accel.get_tracker("jsonl")
        >>> tracker.path
        PosixPath('runs/exp1/metrics.jsonl')
    """

    name = "jsonl"

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.config_path = run_dir / "config.json"
        self._file: IO[str] = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    @property
    def closed(self) -> bool:
        """Whether :meth:`finish` has closed the file."""
        return self._file.closed

    def store_config(self, config: Mapping[str, Any]) -> None:
        """Write ``config.json`` (atomically; values JSON cannot hold are written as text)."""
        tmp = self.config_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(config), indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.config_path)

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """Append ``{"step": step, "time": now, **values}`` as one line and flush it."""
        for key in RESERVED_KEYS:
            if key in values:
                raise LogValueError(
                    f"The key {key!r} is reserved in metrics.jsonl rows (they hold 'step' and "
                    f"'time' themselves). Pass the step as `accel.log(values, step=...)` or "
                    f"rename the key, e.g. {'train_' + key!r}."
                )
        row = {"step": step, "time": time.time(), **values}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def finish(self) -> None:
        """Flush and close the file."""
        if not self._file.closed:
            self._file.close()

    @property
    def native(self) -> JsonlTracker:
        """The tracker itself (it has ``path`` and ``config_path``)."""
        return self


def start(run: RunInfo) -> JsonlTracker:
    """Start the jsonl tracker for ``run`` (writes ``config.json`` when a config is given)."""
    if run.options:
        raise ArgumentTypeError(
            f"The jsonl tracker takes no init options, got {dict(run.options)!r}; remove "
            "'jsonl' from `init_kwargs`."
        )
    tracker = JsonlTracker(run.run_dir)
    if run.config:
        tracker.store_config(run.config)
    return tracker


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read back a ``metrics.jsonl`` file as a list of rows.

    Example:
        >>> rows = read_jsonl("runs/exp1/metrics.jsonl")
        >>> rows[0]["loss"], rows[0]["step"]
        (0.5, 1)
    """
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

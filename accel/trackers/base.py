"""The tracker protocol, the run description handed to adapters, and value conversion.

A tracker is any object with this small protocol (built-in adapters and your own alike):

- ``name: str`` — how :func:`accel.get_tracker` finds it (unique within a run).
- ``log(values, step)`` — ``values`` maps ``str`` keys to ``int``, ``float`` or ``str`` (already
  converted and flattened by :func:`accel.log`); ``step`` is an ``int`` or ``None``.
- ``finish()`` — flush and close; called once when the ``tracking()`` block ends, also after
  an exception.

Optional members, used when present:

- ``store_config(config)`` — called once at start with the run's config as a plain ``dict``.
- ``on_error(exc)`` — called before ``finish()`` when the block raised (mark the run failed).
- ``native`` — what :func:`accel.get_tracker` returns (default: the tracker itself).

A custom tracker is passed as an instance in ``log_with``; accel only calls it on the main
process.

Example:
    >>> class PrintTracker:
    ...     name = "print"
    ...     def log(self, values, step):
    ...         print(step, values)
    ...     def finish(self):
    ...         pass
    >>> with accel.tracking("runs", log_with=["jsonl", PrintTracker()]):
    ...     accel.log({"loss": 0.5}, step=1)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from accel.errors import LogValueError

__all__ = [
    "LogValue",
    "RunInfo",
    "Tracker",
    "to_loggable",
    "to_loggable_skipping_none",
]

LogValue = int | float | str


@runtime_checkable
class Tracker(Protocol):
    """What accel needs from a tracker (see the module docstring for the optional members)."""

    name: str

    def log(self, values: Mapping[str, LogValue], step: int | None) -> None:
        """Record one set of values at ``step`` (``None``: the tracker's own counter)."""

    def finish(self) -> None:
        """Flush and close; called once at the end of the ``tracking()`` block."""


@attrs.frozen(kw_only=True)
class RunInfo:
    """What a built-in adapter needs to start: where, which run, which config, its options.

    Attributes:
        project_dir: the ``project_dir`` given to ``tracking()``.
        run_name: the run's name (given, or generated from the start time).
        run_dir: ``project_dir / run_name``, created before adapters start.
        config: the run's hyper-parameters as a plain dict (empty when none were given).
        options: this adapter's entry of ``init_kwargs`` (passed to the native init call).
        picked_by_all: ``True`` when the tracker runs only because ``log_with`` holds
            ``"all"`` (it was not named), so it should not reach out on its own (wandb starts
            offline unless a mode was set).
    """

    project_dir: Path
    run_name: str
    run_dir: Path
    config: Mapping[str, Any] = attrs.field(factory=dict)
    options: Mapping[str, Any] = attrs.field(factory=dict)
    picked_by_all: bool = False


def _convert(key: str, value: Any) -> LogValue:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float(value)  # numpy.float64 subclasses float: store the plain float
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise LogValueError(
                f"accel.log() logs scalars, but {key!r} is a tensor of shape "
                f"{tuple(value.shape)} ({value.numel()} elements). Reduce it first, e.g. "
                f"`accel.log({{{key!r}: value.mean()}})`."
            )
        return _convert(key, value.item())
    if type(value).__module__.startswith("numpy") and getattr(value, "size", 0) == 1:
        return _convert(key, value.item())  # numpy scalar or 1-element array
    raise LogValueError(
        f"accel.log() cannot log {key!r}={value!r:.80} of type {type(value).__name__}; "
        "values must be int, float, str, a 1-element tensor or a numpy scalar (or a dict of "
        f"them). Convert it first, e.g. `accel.log({{{key!r}: float(value)}})`."
    )


def _flatten(
    prefix: str,
    values: Mapping[Any, Any],
    out: dict[str, LogValue],
    skipped: list[str] | None = None,
) -> None:
    for key, value in values.items():
        if not isinstance(key, str):
            raise LogValueError(
                f"accel.log() needs string keys, got {key!r} of type {type(key).__name__}. "
                f"Use e.g. `accel.log({{{str(key)!r}: value}})`."
            )
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, Mapping):
            _flatten(name, value, out, skipped)
        elif value is None and skipped is not None:
            skipped.append(name)
        else:
            out[name] = _convert(name, value)


def to_loggable(values: Mapping[str, Any]) -> dict[str, LogValue]:
    """Convert ``values`` to plain ``int``/``float``/``str``; nested dicts become ``a/b`` keys.

    One-element tensors and numpy scalars are converted with ``.item()``; ``bool`` becomes
    ``int``. Anything else raises :class:`LogValueError` (nothing is silently dropped).

    Example:
        >>> to_loggable({"loss": torch.tensor(0.5), "eval": {"acc": 0.9}})
        {'loss': 0.5, 'eval/acc': 0.9}
    """
    return _flat_values(values, None)


def _flat_values(values: Mapping[str, Any], skipped: list[str] | None) -> dict[str, LogValue]:
    if not isinstance(values, Mapping):
        raise LogValueError(
            f"accel.log() takes a dict of values, got {type(values).__name__} {values!r:.80}. "
            "Write e.g. `accel.log({'loss': loss}, step=step)`."
        )
    out: dict[str, LogValue] = {}
    _flatten("", values, out, skipped)
    return out


def to_loggable_skipping_none(
    values: Mapping[str, Any],
) -> tuple[dict[str, LogValue], tuple[str, ...]]:
    """Like :func:`to_loggable`, but ``None`` values are left out and their names returned.

    What ``accel.log`` uses: a value that is not there yet (diffusers' ``EMAModel`` reports
    ``decay=None`` before its first step) is skipped, as Accelerate's trackers skip it; every
    other value keeps its check.

    Returns:
        The converted values and the (flattened) names of the ``None`` values skipped.

    Example:
        >>> to_loggable_skipping_none({"loss": 0.5, "ema": {"decay": None}})
        ({'loss': 0.5}, ('ema/decay',))
    """
    skipped: list[str] = []
    out = _flat_values(values, skipped)
    return out, tuple(skipped)

"""Experiment tracking: ``with accel.tracking(...)``, ``accel.log``, ``accel.get_tracker``.

Trackers run on the main process only: other ranks enter the same block, their ``log`` calls
return at once, and no duplicate runs are created. Every tracker is finished and flushed when
the block ends, also when it raises. The active run is per context (a `ContextSlot`), so nested
or concurrent ``tracking()`` blocks in different threads/tasks do not mix.

Built-in trackers (``log_with`` names): ``"jsonl"`` (no dependency), ``"tensorboard"``,
``"wandb"``, ``"mlflow"``, ``"aim"``, ``"comet_ml"``, ``"clearml"``, ``"dvclive"``,
``"swanlab"``, ``"trackio"`` (each with the extra of its name, e.g. ``accel[aim]``; all of
them: ``accel[trackers]``). The last six are offline or local unless you ask for online in
their ``init_kwargs`` (see each module). ``log_with="all"`` picks jsonl and every installed
one (wandb offline unless a mode is set).
Custom trackers: see :mod:`accel.trackers.base`. Run names are single directory names, so a
run never writes outside ``project_dir``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import operator
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import MappingProxyType
from typing import Any

import attrs

from accel.core.scope import ContextSlot
from accel.core.state import state
from accel.errors import (
    ConfigError,
    LogValueError,
    TrackerUnavailableError,
    TrackingNotActiveError,
)
from accel.trackers.base import RunInfo, Tracker, to_loggable_skipping_none

__all__ = ["TrackingRun", "get_tracker", "log", "tracking"]


@attrs.frozen
class _Builtin:
    module: str  # the adapter module (has ``start(run: RunInfo) -> Tracker``)
    package: str | None  # the import name it needs, None for no dependency
    extra: str | None  # the accel extra that installs it


_BUILTINS: Mapping[str, _Builtin] = MappingProxyType(
    {
        "jsonl": _Builtin("accel.trackers.jsonl", None, None),
        "tensorboard": _Builtin("accel.trackers.tensorboard", "tensorboard", "tensorboard"),
        "wandb": _Builtin("accel.trackers.wandb", "wandb", "wandb"),
        "mlflow": _Builtin("accel.trackers.mlflow", "mlflow", "mlflow"),
        "aim": _Builtin("accel.trackers.aim", "aim", "aim"),
        "comet_ml": _Builtin("accel.trackers.comet_ml", "comet_ml", "comet_ml"),
        "clearml": _Builtin("accel.trackers.clearml", "clearml", "clearml"),
        "dvclive": _Builtin("accel.trackers.dvclive", "dvclive", "dvclive"),
        "swanlab": _Builtin("accel.trackers.swanlab", "swanlab", "swanlab"),
        "trackio": _Builtin("accel.trackers.trackio", "trackio", "trackio"),
    }
)


def _readonly(trackers: Mapping[str, Tracker]) -> Mapping[str, Tracker]:
    return MappingProxyType(dict(trackers))


@attrs.frozen(kw_only=True)
class TrackingRun:
    """The run of an active ``tracking()`` block (what ``with accel.tracking(...) as run`` gives).

    Attributes:
        name: the run name on the main process (given or generated); the given name or
            ``None`` on other ranks.
        directory: ``project_dir / name`` on the main process, ``None`` on other ranks.
        tracker_names: the names of the requested trackers, on every rank.
        trackers: name -> started tracker, on the main process only (empty elsewhere).
    """

    name: str | None
    directory: Path | None
    tracker_names: tuple[str, ...]
    trackers: Mapping[str, Tracker] = attrs.field(converter=_readonly)
    # the keys whose None value this block already warned about (this block's own record)
    _none_said: set[str] = attrs.field(factory=set, init=False, repr=False, eq=False)

    @property
    def active(self) -> bool:
        """Whether this process writes (it is the main process and has trackers)."""
        return bool(self.trackers)


_RUN: ContextSlot[TrackingRun] = ContextSlot("accel.trackers run")


def _is_tracker(obj: object) -> bool:
    return (
        isinstance(getattr(obj, "name", None), str)
        and callable(getattr(obj, "log", None))
        and callable(getattr(obj, "finish", None))
    )


def _installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None


def _resolve(log_with: str | Sequence[str | Tracker] | None) -> list[str | Tracker]:
    """Validate ``log_with`` (on every rank): builtin names (lowercased) and tracker objects."""
    if log_with is None:
        return []
    if isinstance(log_with, str) or _is_tracker(log_with):
        given: list[Any] = [log_with]
    else:
        given = list(log_with)
    named = {item.lower() for item in given if isinstance(item, str)}
    items: list[Any] = []
    for item in given:  # "all": jsonl and every installed optional tracker
        if isinstance(item, str) and item.lower() == "all":
            items += [n for n, b in _BUILTINS.items() if _installed(b.package) and n not in named]
        else:
            items.append(item)
    out: list[str | Tracker] = []
    seen: set[str] = set()
    for item in items:
        if isinstance(item, str):
            name = item.lower()
            if name not in _BUILTINS:
                raise ConfigError(
                    f"Unknown tracker {item!r} in log_with; choose from {list(_BUILTINS)} or "
                    "'all', or pass a tracker object (see accel.trackers.base), e.g. "
                    "`accel.tracking(dir, log_with=('jsonl', 'tensorboard'))`."
                )
            entry: str | Tracker = name
        elif _is_tracker(item):
            name = item.name
            entry = item
        else:
            raise ConfigError(
                f"log_with entries are tracker names or tracker objects (with `name`, "
                f"`log(values, step)` and `finish()`), got {type(item).__name__} {item!r:.60}."
            )
        if name in seen:
            raise ConfigError(f"Tracker {name!r} appears twice in log_with={log_with!r}.")
        seen.add(name)
        out.append(entry)
    return out


def _picked_by_all(log_with: str | Sequence[str | Tracker] | None) -> frozenset[str]:
    """The builtin names that only ``"all"`` chose (not also named in ``log_with``)."""
    if log_with is None or _is_tracker(log_with):
        return frozenset()
    given = [log_with] if isinstance(log_with, str) else list(log_with)
    names = {item.lower() for item in given if isinstance(item, str)}
    if "all" not in names:
        return frozenset()
    return frozenset(_BUILTINS) - names


def _why_not_a_run_name(name: str) -> str | None:
    """What makes ``name`` unfit as one directory inside ``project_dir`` (``None``: fit)."""
    if name == "":
        return "is empty"
    if "\0" in name:
        return "contains a NUL character"
    if PurePosixPath(name).anchor or PureWindowsPath(name).anchor:
        return "is an absolute path"
    if "/" in name or "\\" in name:
        return "contains a path separator ('/' or '\\')"
    if name in (".", ".."):
        return "names the project directory or its parent"
    return None


def _check_run_name(run_name: str | os.PathLike[str] | None) -> str | None:
    """Validate ``run_name`` (on every rank): one plain directory name, or ``None``.

    Each run writes to ``project_dir / run_name``, so a name that is absolute, holds a path
    separator or is ``"."``/``".."`` would put files outside ``project_dir`` (or mix runs).
    This is the one place that rule is enforced; adapters get a checked ``run_dir``.
    """
    if run_name is None:
        return None
    name = os.fspath(run_name) if isinstance(run_name, os.PathLike) else run_name
    if not isinstance(name, str):
        raise ConfigError(
            f"run_name must be a string, got {type(run_name).__name__} {run_name!r:.60}. "
            "Pass e.g. `run_name='exp1'`."
        )
    problem = _why_not_a_run_name(name)
    if problem is not None:
        raise ConfigError(
            f"run_name={name!r} {problem}; a run writes to project_dir/<run_name>/, so the "
            "name must be a single directory name inside project_dir. Pass a plain name, "
            "e.g. `run_name='exp1'`, and choose where runs go with `project_dir`."
        )
    return name


def _plain_config(config: object) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if attrs.has(type(config)):
        return attrs.asdict(config)  # type: ignore[arg-type]
    if hasattr(config, "__dict__") and not callable(config):  # argparse.Namespace & co.
        return dict(vars(config))
    raise ConfigError(
        f"config must be a dict, a dataclass or an argparse.Namespace, got "
        f"{type(config).__name__} {config!r:.60}. Pass e.g. `config=vars(args)`."
    )


def _new_run_dir(project_dir: Path, run_name: str | None) -> tuple[str, Path]:
    if run_name is not None:
        return run_name, project_dir / run_name
    base = time.strftime("run-%Y%m%d-%H%M%S")
    name, suffix = base, 1
    while (project_dir / name).exists():
        name, suffix = f"{base}-{suffix}", suffix + 1
    return name, project_dir / name


def _require_installed(name: str) -> None:
    spec = _BUILTINS[name]
    if not _installed(spec.package):
        raise TrackerUnavailableError(
            f"log_with includes {name!r}, which needs the package {spec.package!r}, not "
            f"installed. Install it with `pip install 'accel[{spec.extra}]'` or remove "
            f"{name!r} from log_with."
        )


def _start_builtin(name: str, run: RunInfo) -> Tracker:
    _require_installed(name)
    start: Callable[[RunInfo], Tracker] = importlib.import_module(_BUILTINS[name].module).start
    return start(run)


def _finish(trackers: Sequence[Tracker], error: BaseException | None) -> None:
    """Finish every tracker (even if one fails); raise the first failure unless ``error``."""
    failures: list[BaseException] = []
    for tracker in trackers:
        try:
            if error is not None and callable(getattr(tracker, "on_error", None)):
                tracker.on_error(error)  # type: ignore[attr-defined]
            tracker.finish()
        except Exception as exc:
            failures.append(exc)
    if not failures:
        return
    if error is not None:
        if hasattr(error, "add_note"):
            for failure in failures:
                error.add_note(f"(also, finishing a tracker failed: {failure!r})")
        return
    raise failures[0]


def _start_all(
    entries: Sequence[str | Tracker],
    project_dir: Path,
    run_name: str | None,
    config: dict[str, Any],
    init_kwargs: Mapping[str, Mapping[str, Any]],
    picked_by_all: frozenset[str] = frozenset(),
) -> TrackingRun:
    names = tuple(e if isinstance(e, str) else e.name for e in entries)
    for entry in entries:  # fail before creating anything when a package is missing
        if isinstance(entry, str):
            _require_installed(entry)
    name, run_dir = _new_run_dir(project_dir, run_name)
    if any(isinstance(e, str) for e in entries):
        run_dir.mkdir(parents=True, exist_ok=True)
    started: list[Tracker] = []
    try:
        for entry in entries:
            if isinstance(entry, str):
                info = RunInfo(
                    project_dir=project_dir,
                    run_name=name,
                    run_dir=run_dir,
                    config=config,
                    options=dict(init_kwargs.get(entry, {})),
                    picked_by_all=entry in picked_by_all,
                )
                started.append(_start_builtin(entry, info))
            else:
                store = getattr(entry, "store_config", None)
                if config and callable(store):
                    store(dict(config))
                started.append(entry)
    except BaseException as exc:
        _finish(started, exc)
        raise
    return TrackingRun(
        name=name,
        directory=run_dir,
        tracker_names=names,
        trackers={t.name: t for t in started},
    )


@contextmanager
def tracking(
    project_dir: str | Path,
    *,
    log_with: str | Sequence[str | Tracker] | None = ("jsonl",),
    config: Mapping[str, Any] | object | None = None,
    run_name: str | None = None,
    init_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
) -> Iterator[TrackingRun]:
    """Track an experiment for the block: start trackers on the main process, finish on exit.

    Enter it on every rank (it is not a collective, so it also works on one rank only, e.g.
    inside an ``@accel.on_main_process`` function). Only the main process creates the run
    directory and the trackers; on other ranks :func:`log` returns at once. On exit, also
    after an exception, every tracker is finished and flushed (wandb, mlflow, aim, clearml,
    swanlab and trackio runs are marked failed, or alerted, when the block raised).

    Args:
        project_dir: the directory holding the runs; each run writes to
            ``project_dir/<run_name>/``.
        log_with: tracker names (``"jsonl"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"``,
            ``"aim"``, ``"comet_ml"``, ``"clearml"``, ``"dvclive"``, ``"swanlab"``,
            ``"trackio"``), ``"all"`` for jsonl plus every installed one (a wandb run started
            only because of ``"all"`` is offline unless ``WANDB_MODE`` or ``init_kwargs`` sets
            a mode),
            tracker objects (see :mod:`accel.trackers.base`), or ``None``/``()`` for none.
        config: the run's hyper-parameters (dict, dataclass or ``argparse.Namespace``):
            ``config.json`` for jsonl, the wandb config, mlflow params, a tensorboard text
            (the other trackers: see their modules).
        run_name: the run's name; default ``run-YYYYmmdd-HHMMSS`` (made unique). Reusing a
            name continues that run's directory (jsonl appends). It must be one plain
            directory name: not empty, ``"."`` or ``".."``, not absolute, without ``/`` or
            ``\\``, so that nothing is written outside ``project_dir``.
        init_kwargs: per-tracker options for the native init call, e.g.
            ``{"wandb": {"mode": "offline"}, "mlflow": {"tracking_uri": "..."}}``.

    Yields:
        The :class:`TrackingRun` (its ``directory`` is ``None`` on non-main ranks).

    Raises:
        ConfigError: unknown tracker name, bad config or a ``run_name`` that is not a plain
            directory name.
        TrackerUnavailableError: a tracker's package is not installed (names the extra).

    Example:
        >>> with accel.tracking("runs", log_with=("jsonl", "tensorboard"), config=hparams):
        ...     for step, batch in enumerate(loader):
        ...         loss = train_step(batch)
        ...         accel.log({"loss": loss}, step=step)
    """
    if not isinstance(project_dir, str | os.PathLike):
        raise ConfigError(
            f"accel.tracking() takes the project directory as a path, got "
            f"{type(project_dir).__name__} {project_dir!r:.60}. Pass e.g. "
            "`accel.tracking('runs')`."
        )
    entries = _resolve(log_with)  # every rank validates the arguments
    run_name = _check_run_name(run_name)
    settings = _plain_config(config)
    if init_kwargs is not None and not (
        isinstance(init_kwargs, Mapping)
        and all(isinstance(value, Mapping) for value in init_kwargs.values())
    ):
        raise ConfigError(
            f"init_kwargs={init_kwargs!r:.80} must map tracker names to dicts of options, "
            "e.g. `init_kwargs={'wandb': {'mode': 'offline'}}`."
        )
    options = dict(init_kwargs or {})
    names = tuple(e if isinstance(e, str) else e.name for e in entries)
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(
            f"init_kwargs has options for {unknown!r}, which are not in log_with {names!r}; "
            f"add them to log_with or remove them from init_kwargs."
        )
    if state().is_main_process:
        run = _start_all(
            entries, Path(project_dir), run_name, settings, options, _picked_by_all(log_with)
        )
    else:
        run = TrackingRun(name=run_name, directory=None, tracker_names=names, trackers={})
    previous = _RUN.set(run)
    try:
        yield run
    except BaseException as exc:
        _RUN.set(previous)
        _finish(list(run.trackers.values()), exc)
        raise
    _RUN.set(previous)
    _finish(list(run.trackers.values()), None)


def _step(step: object) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool):
        raise LogValueError(f"step={step!r} must be an int (or None), e.g. `step=100`.")
    try:
        return operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        if hasattr(step, "numel") and step.numel() == 1:  # a 1-element integer tensor
            return _step(step.item())  # type: ignore[attr-defined]
        raise LogValueError(
            f"step={step!r:.60} must be an int (or None), e.g. `step=100`."
        ) from None


def _warn_skipped(run: TrackingRun, skipped: Sequence[str]) -> None:
    """Warn once per key and tracking block that a ``None`` value was skipped."""
    for name in skipped:
        if name in run._none_said:
            continue
        run._none_said.add(name)
        warnings.warn(
            f"accel.log() skipped {name!r}: its value is None (e.g. diffusers' EMAModel decay "
            "before its first step), which has no number to log. None values are skipped, "
            "said once per key and tracking block; to silence this, leave the key out until "
            "it has a value, e.g. `accel.log({k: v for k, v in logs.items() if v is not None})`.",
            UserWarning,
            stacklevel=3,
        )


def log(values: Mapping[str, Any], *, step: int | None = None) -> None:
    """Log ``values`` to every tracker of the active ``tracking()`` block (main process only).

    Not a collective: call it on every rank or on the main process only (also inside an
    ``@accel.on_main_process`` function). On other ranks it returns at once, without
    converting anything. One-element tensors and numpy scalars are converted with
    ``.item()``; nested dicts become ``"outer/inner"`` keys; ``None`` values are skipped
    (a ``UserWarning`` names each such key once per tracking block, as Accelerate's trackers
    skip them); other values are refused.

    Args:
        values: metric name -> int, float, str, 1-element tensor, numpy scalar (or a dict of
            them); ``None`` values are skipped.
        step: the training step (``None``: each tracker's own counter; jsonl writes null).

    Raises:
        TrackingNotActiveError: on the main process, outside ``with accel.tracking(...)``.
        LogValueError: a value cannot be logged (a ``TypeError`` and ``ValueError``).

    Example:
        >>> accel.log({"loss": loss, "lr": scheduler.get_last_lr()[0]}, step=step)
    """
    run = _RUN.get()
    if run is None:
        if not state().is_main_process:
            return
        raise TrackingNotActiveError(
            "accel.log() was called outside a tracking block, so there is nowhere to log. "
            "Wrap the training loop in `with accel.tracking(project_dir, log_with=('jsonl',)):`."
        )
    if not run.trackers:
        return
    at = _step(step)
    clean, skipped = to_loggable_skipping_none(values)
    _warn_skipped(run, skipped)
    if skipped and not clean:
        return  # only None values: nothing to write
    for tracker in run.trackers.values():
        tracker.log(clean, at)


def get_tracker(name: str) -> Any:
    """The native object of an active tracker (main process); ``None`` on other ranks.

    ``"jsonl"``: the jsonl tracker (``.path``); ``"tensorboard"``: the ``SummaryWriter``;
    ``"wandb"``: the wandb run; ``"mlflow"``: the tracker (``.client``, ``.run_id``);
    ``"aim"``: the ``aim.Run``; ``"comet_ml"``: the Comet experiment; ``"clearml"``: the
    ClearML ``Task``; ``"dvclive"``: the ``dvclive.Live``; ``"swanlab"``, ``"trackio"``: their
    run; a custom tracker: its ``native`` attribute if it has one, else the object.

    Raises:
        TrackingNotActiveError: called outside ``with accel.tracking(...)``.
        ConfigError: ``name`` is not one of the block's trackers.

    Example:
        >>> writer = accel.get_tracker("tensorboard")
        >>> if writer is not None:
        ...     writer.add_histogram("weights", model.weight, step)
    """
    run = _RUN.get()
    if run is None:
        raise TrackingNotActiveError(
            f"accel.get_tracker({name!r}) was called outside a tracking block. Call it "
            "inside `with accel.tracking(project_dir, log_with=(...)):`."
        )
    key = name.lower() if name.lower() in _BUILTINS else name
    if key not in run.tracker_names:
        raise ConfigError(
            f"No tracker named {name!r} in this tracking block; its trackers are "
            f"{list(run.tracker_names)}. Add it to `log_with`."
        )
    tracker = run.trackers.get(key)
    if tracker is None:  # not the main process
        return None
    return getattr(tracker, "native", tracker)

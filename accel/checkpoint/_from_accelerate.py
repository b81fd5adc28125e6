"""``load_state`` of HuggingFace Accelerate's ``save_state`` directories.

:mod:`accel.checkpoint.foreign.accelerate` finds such a directory and reads it (running no
pickle); here every rank agrees on it, each state is checked against its object while it is
read (:func:`~accel.checkpoint._fit.check_fits`), and only then are the objects changed
(:func:`~accel.checkpoint._loading.load_into`). One log line names the files used, and a
warning the pickles never opened.

Example:
    >>> load_accelerate_state(Path("acc_ckpt"), [], {"model": model})
    AccelerateCheckpointInfo(path=PosixPath('acc_ckpt'), step=None, ...)
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import attrs

from accel.checkpoint._agreement import agreed_target
from accel.checkpoint._fit import check_fits
from accel.checkpoint._loading import CheckpointInfo, load_into
from accel.checkpoint._saving import unwrap
from accel.checkpoint.foreign.accelerate import AccelerateRead, is_accelerate, read_accelerate
from accel.comm.failures import agree_on_failure
from accel.comm.gating import get_logger
from accel.core.scope import scope
from accel.errors import CheckpointError

__all__ = ["AccelerateCheckpointInfo", "load_accelerate_state"]

_LOG = get_logger(__name__)


@attrs.frozen
class AccelerateCheckpointInfo(CheckpointInfo):
    """A :class:`CheckpointInfo` for a checkpoint written by Accelerate's ``save_state``.

    ``step`` is ``None`` (Accelerate keeps it in the pickled RNG files) and ``world_size`` is
    the number of ``random_states_N.pkl`` files (1 when there is none).

    Example:
        >>> accel.load_state("acc_ckpt", model=model).files_used
        ('model.safetensors',)
    """

    files_used: tuple[str, ...] = ()
    files_refused: tuple[str, ...] = ()


def _target(directory: Path, names: list[str]) -> Path | None:
    if not names:
        return directory if is_accelerate(directory) else None
    newest = Path(names[0])
    return newest if is_accelerate(newest) else None


def load_accelerate_state(
    directory: Path, names: list[str], objects: dict[str, Any]
) -> CheckpointInfo | None:
    """Load an Accelerate ``save_state`` directory into ``objects``, or ``None`` if it is none.

    Every rank must call it, with the candidates ``load_state`` agreed on (``names``, newest
    first; empty when ``directory`` is no accel checkpoint or root). The checkpoint is
    ``directory`` itself, or the newest ``checkpoint_N`` under it. Every rank reads and checks
    every file before any object changes, and a failure on one rank is raised on all.

    Raises:
        CheckpointError: the ranks disagree on the layout, a requested object has no file or
            its state lives in a pickle, a file is refused, or a state does not fit.

    Example:
        >>> load_accelerate_state(Path("acc_ckpt"), [], {"model": model})
        AccelerateCheckpointInfo(path=PosixPath('acc_ckpt'), step=None, ...)
    """
    target = agreed_target(directory, _target(directory, names), "Accelerate")  # every rank
    if target is None:
        return None
    with agree_on_failure(lambda errors: CheckpointError(
        f"load_state({os.fspath(directory)!r}) cannot load the Accelerate checkpoint at "
        f"{os.fspath(target)!r}: {errors}"
    )):
        unwrapped = {name: unwrap(obj) for name, obj in objects.items()}
        read = read_accelerate(target, unwrapped, check=check_fits)
    with agree_on_failure(lambda errors: CheckpointError(
        f"load_state({os.fspath(directory)!r}) failed while restoring the Accelerate "
        f"checkpoint at {os.fspath(target)!r}: {errors}"
    )):
        for name, obj in objects.items():
            load_into(name, obj, read.states[name])
        scaler = scope().grad_scaler
        if read.scaler is not None and scaler is not None:
            scaler.load_state_dict(read.scaler)
    _report(target, read)
    return AccelerateCheckpointInfo(
        path=target, step=None, world_size=read.world_size, objects=tuple(objects),
        files_used=read.used, files_refused=read.refused,
    )


def _report(target: Path, read: AccelerateRead) -> None:
    _LOG.info(
        "load_state read the Accelerate checkpoint %r: used %s; not used %s; refused "
        "(pickles, never opened) %s.", os.fspath(target), list(read.used), list(read.unused),
        list(read.refused),
    )
    if read.refused:
        what = ("RNG states were not restored" if read.rng_refused
                else "nothing was restored from pickles")
        warnings.warn(
            f"load_state({os.fspath(target)!r}), an Accelerate checkpoint: {what}; these "
            f"pickles were not opened: {list(read.refused)} (accel never unpickles: it could "
            "run code). Call `accel.set_seed(...)` to seed the resumed run.",
            stacklevel=4,
        )

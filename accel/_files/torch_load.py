"""``torch.load(weights_only=True)`` of one torch file after accel's checks: the one guarded load.

The file is opened once and checked by :func:`~accel._files.torch_zip.opened_torch_file` (a zip's
directory, members and storage sizes; a file in torch's format before zip, or a bare pickle, by
its pickles), then torch reads *that* open file: a zip is memory-mapped (``mmap=True``: nothing
is read until a tensor is used), an older file is read whole. Its failures become the caller's
:class:`~accel.errors.CheckpointError`: each reader words them for its own files (a weights
file, the state of one object of a checkpoint...).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accel._files.torch_zip import is_zip, opened_torch_file
from accel.errors import CheckpointError

__all__ = ["load_torch_file"]


def load_torch_file(
    path: Path,
    *,
    refused: Callable[[pickle.UnpicklingError], CheckpointError],
    corrupted: Callable[[Exception], CheckpointError],
) -> Any:
    """What ``path`` holds, loaded weights-only on the CPU once its checks pass.

    Args:
        path: the torch file (``torch.save``'s zip format, or its format before zip).
        refused: the error for a file ``torch.load(weights_only=True)`` refuses (it names a
            global, or an operation, that the weights-only unpickler does not allow).
        corrupted: the error for any other failure of reading it (a damaged file, a missing
            one: the unpickler reports them with many error types).

    Returns:
        The loaded object, unchecked: the caller checks it holds what it expects.

    Raises:
        CheckpointError: the file fails accel's checks (not a regular file, a zip or pickle
            that is refused), or the error ``refused`` or ``corrupted`` gives.

    Example:
        >>> load_torch_file(
        ...     Path("optimizer.bin"),
        ...     refused=lambda exc: CheckpointError(f"refused: {exc}"),
        ...     corrupted=lambda exc: CheckpointError(f"corrupted: {exc}"),
        ... )
        {'state': {...}, 'param_groups': [...]}
    """
    try:
        with opened_torch_file(path) as (file, own):  # a zip is checked before it is mapped
            zipped = is_zip(file)
            return torch.load(own if zipped else file, map_location="cpu",
                              weights_only=True, mmap=zipped)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise refused(exc) from None
    except Exception as exc:  # the unpickler reports damaged files with many error types
        raise corrupted(exc) from None

"""Argument checks shared by the checkpoint functions: a path, a model.

They depend only on the arguments, so every rank refuses the same call alike, before any
collective.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from accel.errors import CheckpointArgumentError

__all__ = ["as_module", "as_path"]


def as_path(value: object, op: str, argument: str = "path") -> Path:
    """``value`` as a :class:`~pathlib.Path`, or :class:`CheckpointArgumentError` naming it.

    Example:
        >>> as_path("ckpt", "accel.save_state", "directory")
        PosixPath('ckpt')
    """
    if isinstance(value, str | os.PathLike):
        try:
            return Path(value)
        except TypeError:  # a PathLike whose __fspath__ gives bytes
            pass
    raise CheckpointArgumentError(
        f"{op}() takes a file system path as `{argument}`, got {type(value).__name__} "
        f"{value!r:.60}. Pass a str or a pathlib.Path, e.g. `{argument}='checkpoints/run1'`."
    )


def as_module(value: object, op: str) -> nn.Module:
    """``value`` if it is a ``torch.nn.Module``, else :class:`CheckpointArgumentError`.

    Example:
        >>> as_module(nn.Linear(2, 2), "accel.save_model")
        Linear(in_features=2, out_features=2, bias=True)
    """
    if isinstance(value, nn.Module):
        return value
    raise CheckpointArgumentError(
        f"{op}() takes a torch.nn.Module, got {type(value).__name__} {value!r:.60}. "
        f"Pass the model, e.g. `{op}(model, ...)`."
    )

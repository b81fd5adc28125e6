"""What the loaders of ``load_state`` share: accel's own checkpoints, Accelerate's and DeepSpeed's.

:class:`CheckpointInfo` is what ``load_state`` returns; :func:`load_into` puts a saved state
into its live object. :mod:`accel.checkpoint.state`, :mod:`accel.checkpoint._from_accelerate`
and :mod:`accel.checkpoint._from_deepspeed` import them from here.
:func:`agree_on_copy` is the one collective after which every rank knows every rank's
verification error and that all ranks read copies of one save.

Example:
    >>> load_into("optimizer", optimizer, saved_state)  # a CheckpointError names the object
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from torch import nn

from accel.checkpoint._saving import unwrap
from accel.comm.collectives import gather_object
from accel.comm.failures import label_errors
from accel.errors import CheckpointError

__all__ = ["CheckpointInfo", "agree_on_copy", "load_into"]


@attrs.frozen
class CheckpointInfo:
    """What :func:`~accel.checkpoint.state.load_state` loaded: where from, which step, and
    what it held.

    Example:
        >>> accel.save_state("ckpt", step=3, model=model)
        >>> info = accel.load_state("ckpt", model=model)
        >>> info.path, info.step, info.world_size, info.objects
        (PosixPath('ckpt/checkpoint_3'), 3, 1, ('model',))
    """

    path: Path
    """The checkpoint directory that was loaded."""
    step: int | None
    """The ``step`` it was saved with, or ``None``."""
    world_size: int
    """The number of processes that saved it."""
    objects: tuple[str, ...]
    """The names of the objects it holds (the keywords they were saved under)."""


def load_into(name: str, obj: Any, state_dict: Any) -> None:
    """``obj.load_state_dict(state_dict)`` (strict for a module, unwrapped first).

    Raises:
        CheckpointError: the object refused the state; names the object and why.
    """
    target = unwrap(obj)
    try:
        if isinstance(target, nn.Module):
            target.load_state_dict(state_dict, strict=True)
        else:
            target.load_state_dict(state_dict)
    except Exception as exc:
        raise CheckpointError(
            f"{name}.load_state_dict() refused the checkpoint's {name!r} "
            f"({type(exc).__name__}: {exc}). Pass the object it was saved from."
        ) from exc


def agree_on_copy(error: str | None, save_id: str | None, what: str) -> list[str]:
    """Every rank's error (``[]`` when none failed): one collective, the same on all ranks.

    Copies from different saves (``save_id``, the manifest's, as each rank read it) are an
    error too: machines' ``on_each_node`` copies where the save completed on some machines
    only, or a checkpoint replaced while the ranks read it.
    """
    reports = gather_object((error, save_id))
    errors = label_errors([e for e, _ in reports])
    ids = {i for _, i in reports}
    if not errors and len(ids) > 1:
        errors = [
            f"the ranks read copies of {what} from different saves (save ids "
            f"{sorted(str(i) for i in ids)}): with on_each_node=True a save completed on some "
            "machines only, or the checkpoint was replaced while loading"
        ]
    return errors

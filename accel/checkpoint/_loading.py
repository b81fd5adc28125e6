"""What both readers of ``load_state`` share: accel's own checkpoints and Accelerate's.

:class:`CheckpointInfo` is what ``load_state`` returns; :func:`load_into` puts a saved state
into its live object; :func:`agree` is the one collective after which every rank knows every
rank's error. :mod:`accel.checkpoint.state` and :mod:`accel.checkpoint._accelerate_format` both
import them from here, so neither imports the other's private names.

Example:
    >>> load_into("optimizer", optimizer, saved_state)  # a CheckpointError names the object
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from torch import nn

from accel._state import state
from accel.checkpoint._saving import unwrap
from accel.collectives import gather_object
from accel.errors import CheckpointError

__all__ = ["CheckpointInfo", "agree", "load_into"]


@attrs.frozen
class CheckpointInfo:
    """What :func:`~accel.checkpoint.state.load_state` loaded: where from, which step, and
    what it held."""

    path: Path
    step: int | None
    world_size: int
    objects: tuple[str, ...]


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


def agree(error: str | None, save_id: str | None = None, what: str = "") -> list[str]:
    """Every rank's error (``[]`` when none failed): one collective, the same on all ranks.

    With ``save_id`` (the manifest's, as each rank read it), copies from different saves
    are an error too: machines' ``on_each_node`` copies where the save completed on some
    machines only, or a checkpoint replaced while the ranks read it.
    """
    reports = gather_object((error, save_id))
    errors = [f"rank {r}: {e}" if state().world_size > 1 else e
              for r, (e, _) in enumerate(reports) if e is not None]
    ids = {i for _, i in reports}
    if not errors and len(ids) > 1:
        errors = [
            f"the ranks read copies of {what} from different saves (save ids "
            f"{sorted(str(i) for i in ids)}): with on_each_node=True a save completed on some "
            "machines only, or the checkpoint was replaced while loading"
        ]
    return errors

"""Training state: crash-safe, pickle-free ``save_state`` / ``load_state``.

``state`` (the two functions and ``latest_checkpoint``), ``rng`` (RNG states without pickle),
``_async`` (saves that finish in the background), ``sharded/`` (each rank's own pieces of
DTensor state, and resharding them between meshes), ``foreign/`` (reading checkpoints that
Accelerate's ``save_state`` and DeepSpeed's ``save_checkpoint`` wrote). Model weights alone
are :mod:`accel.weights`.

Names load on first use, so that ``distributed()`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.core.lazy import lazy_names

_LAZY = {
    "CheckpointInfo": "accel.checkpoint._loading",
    "latest_checkpoint": "accel.checkpoint.state",
    "load_state": "accel.checkpoint.state",
    "save_state": "accel.checkpoint.state",
    "wait_for_checkpoints": "accel.checkpoint._async",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from accel.checkpoint._async import wait_for_checkpoints as wait_for_checkpoints
    from accel.checkpoint._loading import CheckpointInfo as CheckpointInfo
    from accel.checkpoint.state import latest_checkpoint as latest_checkpoint
    from accel.checkpoint.state import load_state as load_state
    from accel.checkpoint.state import save_state as save_state


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

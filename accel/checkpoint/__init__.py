"""Checkpoints: model weights in the HF layout, and crash-safe, pickle-free training state.

Names load on first use, so that ``distributed()`` can hold the hook of asynchronous saves
(:mod:`accel.checkpoint._async`, light) without importing the readers and writers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "CheckpointInfo": "accel.checkpoint._loading",
    "get_state_dict": "accel.checkpoint.model_io",
    "latest_checkpoint": "accel.checkpoint.state",
    "load": "accel.checkpoint.model_io",
    "load_state": "accel.checkpoint.state",
    "save": "accel.checkpoint.model_io",
    "save_model": "accel.checkpoint.model_io",
    "save_state": "accel.checkpoint.state",
    "wait_for_checkpoints": "accel.checkpoint._async",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from accel.checkpoint._async import wait_for_checkpoints as wait_for_checkpoints
    from accel.checkpoint._loading import CheckpointInfo as CheckpointInfo
    from accel.checkpoint.model_io import get_state_dict as get_state_dict
    from accel.checkpoint.model_io import load as load
    from accel.checkpoint.model_io import save as save
    from accel.checkpoint.model_io import save_model as save_model
    from accel.checkpoint.state import latest_checkpoint as latest_checkpoint
    from accel.checkpoint.state import load_state as load_state
    from accel.checkpoint.state import save_state as save_state


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'accel.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""Checkpoints: model weights in the HF layout, and crash-safe, pickle-free training state."""

from __future__ import annotations

from accel.checkpoint._async import wait_for_checkpoints
from accel.checkpoint.model_io import (
    get_state_dict,
    load,
    load_checkpoint_in_model,
    save,
    save_model,
)
from accel.checkpoint.state import CheckpointInfo, latest_checkpoint, load_state, save_state

__all__ = [
    "CheckpointInfo",
    "get_state_dict",
    "latest_checkpoint",
    "load",
    "load_checkpoint_in_model",
    "load_state",
    "save",
    "save_model",
    "save_state",
    "wait_for_checkpoints",
]

"""``dispatch_model``, ``cpu_offload``, ``disk_offload``, ``remove_hooks``."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from accel.big_model.offload import TensorSource

__all__ = ["cpu_offload", "disk_offload", "dispatch_model", "remove_hooks"]


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str | torch.device],
    *,
    offload_dir: str | os.PathLike[str] | None = None,
) -> nn.Module:
    """TODO (helper B)."""
    raise NotImplementedError


def dispatch_with_sources(
    model: nn.Module,
    device_map: Mapping[str, torch.device | str],
    sources: Mapping[str, TensorSource],
    *,
    offload_dir: str | os.PathLike[str] | None = None,
) -> nn.Module:
    """Like ``dispatch_model`` for a checked, normalized map, where the weights of "disk"
    modules are already on ``meta`` and ``sources`` says where each one's bytes are (by full
    parameter/buffer name). Used by ``load_checkpoint_and_dispatch`` to map shards in place."""
    raise NotImplementedError


def cpu_offload(
    model: nn.Module, *, execution_device: torch.device | str | int | None = None
) -> nn.Module:
    """TODO (helper B)."""
    raise NotImplementedError


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike[str],
    *,
    execution_device: torch.device | str | int | None = None,
) -> nn.Module:
    """TODO (helper B)."""
    raise NotImplementedError


def remove_hooks(model: nn.Module) -> nn.Module:
    """TODO (helper B)."""
    raise NotImplementedError

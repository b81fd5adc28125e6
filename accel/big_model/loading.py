"""``load_checkpoint_and_dispatch``: stream a checkpoint into a (meta) model by a device map."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
from torch import nn

__all__ = ["load_checkpoint_and_dispatch"]


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device_map: str | Mapping[str, int | str | torch.device] | None = "auto",
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """TODO (helper B)."""
    raise NotImplementedError

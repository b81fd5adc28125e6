"""Offloaded weights: pickle-free files on disk, memory-mapped back on demand (helper B)."""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

__all__ = ["TensorSource"]


@attrs.frozen
class TensorSource:
    """Where one offloaded tensor's bytes live: tensor ``key`` of safetensors file ``path``
    (a checkpoint shard mapped in place, or a file in the offload folder), cast to ``dtype``
    when it is given and the tensor is floating point."""

    path: Path
    key: str
    dtype: torch.dtype | None = None

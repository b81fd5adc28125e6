"""Device maps: place whole submodules on GPUs, ``"cpu"`` and ``"disk"`` within budgets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["get_balanced_memory", "infer_auto_device_map"]


def infer_auto_device_map(
    model: nn.Module,
    *,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, int | str]:
    """TODO (helper A)."""
    raise NotImplementedError


def get_balanced_memory(
    model: nn.Module,
    *,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[int | str, int]:
    """TODO (helper A)."""
    raise NotImplementedError


# --- shared with dispatch.py and loading.py (helper A implements; signatures are the contract)

Device = torch.device | str  # a torch.device, or "disk"


def normalize_device(value: object) -> torch.device | str:
    """``0`` -> ``cuda:0``, ``"cpu"``/``"cuda:1"``/``torch.device`` -> ``torch.device``,
    ``"disk"`` -> ``"disk"``; anything else is a ``DeviceMapError`` naming the value."""
    raise NotImplementedError


def parse_max_memory(max_memory: Mapping[int | str, int | str] | None) -> dict[int | str, int]:
    """Budgets in bytes per device key (GPU indices in order, then "cpu", then "disk"), with
    defaults filled in (free GPU memory, available RAM less a margin; "disk" unbounded).
    A bad key or size string is a ``DeviceMapError`` naming it."""
    raise NotImplementedError


def check_device_map(
    model: nn.Module, device_map: Mapping[str, int | str | torch.device]
) -> dict[str, torch.device | str]:
    """Validate an explicit map (names exist, every parameter and buffer covered exactly once,
    devices valid) and return it normalized (values from ``normalize_device``)."""
    raise NotImplementedError


def resolve_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, int | str | torch.device],
    *,
    max_memory: Mapping[int | str, int | str] | None = None,
    no_split_module_classes: Iterable[type[nn.Module] | str] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.device | str]:
    """``"auto"``/``"balanced"`` (balanced budgets), ``"sequential"`` (fill in order) or an
    explicit map -> a checked, normalized map."""
    raise NotImplementedError


def _unused(x: Any) -> None:  # placeholder so the stub type-checks
    del x

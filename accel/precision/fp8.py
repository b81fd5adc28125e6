"""The fp8 unit: for now it runs as bf16 and says so, once per process.

accel has no fp8 backend yet (torchao's float8 training would go here: converting the linear
layers in ``forward_dtype``'s place, its FSDP all-gather in ``fsdp_policy``'s). Until then
``mixed_precision="fp8"`` is bf16 autocast, the precision fp8 recipes keep outside matmuls,
and the first feature that uses the mode (``prepare_model``, ``accel.autocast()``, a prepared
forward, FSDP sharding) warns :data:`accel.core.settings.FP8_NOTE`, pointing at the user's line.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from accel.core.settings import FP8_NOTE
from accel.precision.half import BFloat16

__all__ = ["Float8"]

_SAID = threading.Event()  # once per process: fp8 runs as bf16
_INTERNAL = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))


def _user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the first frame outside
    accel and torch: the user's line that started using the mode."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _note() -> None:
    """Warn once per process that ``fp8`` runs as bf16 autocast (no fp8 backend yet)."""
    if not _SAID.is_set():
        _SAID.set()
        warnings.warn(FP8_NOTE, UserWarning, stacklevel=_user_stacklevel())


@attrs.frozen
class Float8(BFloat16):
    """``mixed_precision="fp8"``: runs as bf16 (a ``UserWarning`` says so, once per process).

    Example:
        >>> Float8().forward_dtype()  # UserWarning: mixed_precision='fp8' runs as bf16 ...
        torch.bfloat16
    """

    mode: ClassVar[str] = "fp8"

    def autocast(
        self, device_type: str, *, enabled: bool = True, dtype: torch.dtype | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast (said once per process)."""
        _note()
        return super().autocast(device_type, enabled=enabled, dtype=dtype)

    def forward_dtype(self) -> torch.dtype | None:
        """bf16 (said once per process)."""
        _note()
        return super().forward_dtype()

    def forward_casting(self, device_type: str) -> tuple[torch.dtype | None, bool]:
        """bf16 autocast (said once per process)."""
        _note()
        return super().forward_casting(device_type)

    def fsdp_policy(self) -> Any:
        """bf16's policy (said once per process)."""
        _note()
        return super().fsdp_policy()

    def upcast_master_weights(self, model: nn.Module) -> None:
        """fp32 master weights, as bf16 (said once per process)."""
        _note()
        super().upcast_master_weights(model)

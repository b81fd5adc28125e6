"""The 16-bit units: bf16 (autocast) and fp16 (autocast and a GradScaler).

Both run the forward under :func:`torch.autocast` on the state's device type (CPU and CUDA
alike) and keep fp32 master weights under FSDP2, whose ``MixedPrecisionPolicy`` all-gathers
the parameters and reduces the gradients in the 16-bit dtype. fp16's narrow range also needs
loss scaling: the scope's :class:`torch.amp.GradScaler` (``accel.precision.scaling``) scales
the loss in ``backward``, and the prepared optimizer unscales, skips on inf/nan and updates it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from accel.core.scope import scope
from accel.core.state import state
from accel.precision.base import Layouts, Precision, StepRecord
from accel.precision.scaling import mesh_unscale, scaled_step, scope_scaler

__all__ = ["BFloat16", "Float16", "HalfPrecision"]


@attrs.frozen
class HalfPrecision(Precision):
    """A mode that computes in :attr:`dtype` under autocast, with fp32 master weights (a
    subclass sets ``mode`` and ``dtype``).

    Example:
        >>> BFloat16().forward_casting("cpu")
        (torch.bfloat16, True)
    """

    def autocast(
        self, device_type: str, *, enabled: bool = True, dtype: torch.dtype | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """:func:`torch.autocast` in the mode's dtype (or ``dtype``) on ``device_type``.

        Example:
            >>> with BFloat16().autocast("cpu"):
            ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
            torch.bfloat16
        """
        return torch.autocast(
            device_type=device_type, dtype=self.dtype if dtype is None else dtype,
            enabled=enabled,
        )

    def forward_dtype(self) -> torch.dtype | None:
        """The mode's dtype: ``prepare_model`` wraps the forward in autocast.

        Example:
            >>> Float16().forward_dtype()
            torch.float16
        """
        return self.dtype

    def forward_casting(self, device_type: str) -> tuple[torch.dtype | None, bool]:
        """The mode's dtype, enabled as torch's own checks say (device available, dtype
        supported: it raises for an unsupported device, warns and disables an unusable dtype).

        Example:
            >>> BFloat16().forward_casting("cpu")
            (torch.bfloat16, True)
        """
        dtype = self.dtype
        return dtype, bool(torch.autocast(device_type=device_type, dtype=dtype)._enabled)

    def fsdp_policy(self) -> Any:
        """``param_dtype`` and ``reduce_dtype`` set to the mode's dtype.

        The sharded parameters and their gradients stay in their own dtype (fp32 master
        weights). ``output_dtype`` is left unset: the root's forward returns fp32 floats
        through ``prepare_model``'s autocast wrapper.

        Example:
            >>> Float16().fsdp_policy().reduce_dtype
            torch.float16
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=self.dtype)

    def upcast_master_weights(self, model: nn.Module) -> None:
        """Trainable low-precision floating parameters become fp32 (the master weights).

        Example:
            >>> BFloat16().upcast_master_weights(model.to(torch.bfloat16))
        """
        upcast = []
        for name, param in model.named_parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
                upcast.append(name)
        if upcast and state().is_main_process:
            from accel.comm.gating import get_logger

            get_logger(__name__, main_process_only=False).info(
                "FSDP with mixed precision keeps fp32 master weights: %d trainable parameters "
                "were upcast to fp32 (first: %s).", len(upcast), upcast[:5],
            )


@attrs.frozen
class BFloat16(HalfPrecision):
    """``mixed_precision="bf16"``: autocast in bfloat16; no loss scaling (fp32's range).

    Example:
        >>> BFloat16().active_scaler() is None
        True
    """

    mode: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype | None] = torch.bfloat16


@attrs.frozen
class Float16(HalfPrecision):
    """``mixed_precision="fp16"``: autocast in float16, the loss scaled by a GradScaler.

    The scaler is the scope's (made by the first :meth:`optimizer_scaler`), used only while
    the state's mode is fp16: a nested ``accel.distributed(mixed_precision="no")`` block
    trains without loss scaling.

    Example:
        >>> with accel.distributed(mixed_precision="fp16"):
        ...     Float16().optimizer_scaler() is Float16().active_scaler()
        True
    """

    mode: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype | None] = torch.float16

    def optimizer_scaler(self) -> torch.amp.GradScaler | None:
        """The scope's GradScaler, made on the state's device type if none yet."""
        return scope_scaler()

    def active_scaler(self) -> torch.amp.GradScaler | None:
        """The scope's GradScaler (``None`` before any optimizer is prepared)."""
        scaler: torch.amp.GradScaler | None = scope().grad_scaler
        return scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the GradScaler's scale (as it is without a scaler yet)."""
        scaler = scope().grad_scaler
        if scaler is None:
            return loss
        scaled: torch.Tensor = scaler.scale(loss)
        return scaled

    def step(
        self, record: StepRecord, closure: Callable[[], float] | None, layouts: Layouts | None
    ) -> Any:
        """Through the GradScaler: unscale, agree on overflow over the mesh, skip on inf/nan,
        update the scale (as written for an optimizer prepared without a scaler)."""
        if record.scaler is None:
            return super().step(record, closure, layouts)
        return scaled_step(record, closure, layouts)

    def unscale(self, optimizer: Any, record: StepRecord | None, layouts: Layouts | None) -> None:
        """Unscale ``optimizer``'s gradients: a prepared one once per step, through its own
        scaler; another through the scope's (the caller manages its stage)."""
        if record is None:
            scaler = scope().grad_scaler
            if scaler is not None:
                mesh_unscale(scaler, optimizer, layouts)
            return
        if record.scaler is None or record.grads_unscaled:
            return
        mesh_unscale(record.scaler, record.optimizer, layouts)
        record.grads_unscaled = True

    def unscaled_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """``norm`` divided by the scale (while the scaler is enabled)."""
        scaler = scope().grad_scaler
        if scaler is not None and scaler.is_enabled():
            unscaled: torch.Tensor = norm / scaler.get_scale()
            return unscaled
        return norm

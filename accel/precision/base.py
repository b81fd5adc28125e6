"""The precision unit: everything one mixed precision mode decides, and full precision.

A unit is a frozen, stateless object, one per mode (``accel.precision.registry.PRECISIONS``),
asked by the features that depend on the mode instead of branching on the mode's name:
``accel.autocast()`` enters :meth:`Precision.autocast`; ``prepare_model`` swaps layers with
:meth:`Precision.convert_modules` (before any split or sharding; tensor parallelism takes
:meth:`Precision.parallel_styles`) and wraps the forward in
:meth:`Precision.forward_dtype`, and the wrapper runs it as :meth:`Precision.forward_casting`
says; FSDP2 takes :meth:`Precision.fsdp_policy` and :meth:`Precision.upcast_master_weights`;
``prepare_optimizer``, ``backward``, the prepared optimizer's ``step``, unscaling and clipping
go through the loss scaling methods (:meth:`Precision.optimizer_scaler` and after). The unit
holds no state: the GradScaler a mode creates lives in the block's ``Scope``
(``scope().grad_scaler``, saved by ``save_state``), per-optimizer step facts on the prepared
optimizer (:class:`StepRecord`).

:class:`Precision` itself is full precision (mode ``"no"``): no autocast, no wrapper, no FSDP
policy, no loss scaling. Other modes subclass it (``half.py``, ``fp8.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

import attrs
import torch
from torch import nn

__all__ = ["Layouts", "Precision", "StepRecord"]

Layouts = Callable[[list[Any]], list[list[Any]]]
"""Groups parameters with gradients by mesh and placements (plain tensors together), the same
on every rank: ``accel.parallel.fsdp_params.layout_groups``, passed in by the training layer
under an N-D mesh (``None`` without one: one group, unscaled as torch does)."""


class StepRecord(Protocol):
    """What a unit reads and writes on a prepared optimizer around its step.

    ``scaler`` is the GradScaler it was prepared with (``None``: it steps as written);
    ``step_ran`` is set by a post-step hook on the user's optimizer (``step_hook``, ``None``
    where it takes no hooks), so a skipped step is told without patching anything.
    """

    optimizer: Any
    scaler: torch.amp.GradScaler | None
    step_was_skipped: bool
    grads_unscaled: bool
    step_ran: bool
    step_hook: Any


@attrs.frozen
class Precision:
    """Full precision (``mixed_precision="no"``), and what every unit answers.

    Example:
        >>> from accel.precision.registry import precision_for
        >>> unit = precision_for("no")
        >>> unit.forward_dtype() is None, unit.fsdp_policy() is None
        (True, True)
    """

    mode: ClassVar[str] = "no"
    """The ``mixed_precision`` value this unit serves."""
    dtype: ClassVar[torch.dtype | None] = None
    """The dtype autocast computes in (``None``: as written)."""

    # -- the model's layers ---------------------------------------------------------------
    def convert_modules(self, model: nn.Module, *, fsdp: bool, tensor_parallel: bool) -> None:
        """Swap ``model``'s layers for the mode's own, in place, before ``prepare_model``
        splits or shards it (fp8: torchao's ``Float8Linear``). Other modes keep them.

        Args:
            model: the model ``prepare_model`` was given.
            fsdp: FSDP2 will shard it.
            tensor_parallel: a tensor-parallel plan will split it.

        Example:
            >>> precision_for("bf16").convert_modules(model, fsdp=False, tensor_parallel=False)
        """

    def parallel_styles(self, model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
        """The tensor-parallel styles (module name -> torch ``ParallelStyle``) to apply to
        ``model``: the checked plan, or the mode's own styles for its layers.

        Example:
            >>> precision_for("no").parallel_styles(model, {"up": ColwiseParallel()})
            {'up': ColwiseParallel(...)}
        """
        return dict(plan)

    # -- autocast and the prepared forward ------------------------------------------------
    def autocast(
        self, device_type: str, *, enabled: bool = True, dtype: torch.dtype | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        """What ``accel.autocast()`` enters on ``device_type``.

        Full precision: nothing, unless ``dtype`` is given; ``enabled=False`` switches an
        enclosing autocast off (with the device's default dtype).

        Example:
            >>> with precision_for("no").autocast("cpu"):
            ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
            torch.float32
        """
        if dtype is not None:
            return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled)
        if enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, enabled=False)

    def forward_dtype(self) -> torch.dtype | None:
        """The dtype ``prepare_model`` wraps the forward for (``None``: no wrapper).

        Asked once per ``prepare_model``; the wrapper keeps it for ``torch.compile`` regions.

        Example:
            >>> precision_for("bf16").forward_dtype()
            torch.bfloat16
        """
        return None

    def forward_casting(self, device_type: str) -> tuple[torch.dtype | None, bool]:
        """The prepared forward's autocast on ``device_type``: (dtype, enabled).

        Asked once per mode and device by each wrapped forward, which then sets autocast's
        switches itself on every call; ``(None, False)`` runs the forward as written.

        Example:
            >>> precision_for("fp16").forward_casting("cpu")
            (torch.float16, True)
        """
        return None, False

    # -- FSDP2 ----------------------------------------------------------------------------
    def fsdp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for the mode, or ``None`` (full precision).

        Example:
            >>> precision_for("bf16").fsdp_policy().param_dtype
            torch.bfloat16
        """
        return None

    def upcast_master_weights(self, model: nn.Module) -> None:
        """Make ``model``'s trainable parameters fp32 master weights before FSDP shards it.

        Full precision keeps the parameters as they are.

        Example:
            >>> precision_for("bf16").upcast_master_weights(model.to(torch.bfloat16))
        """

    # -- loss scaling (the GradScaler's life) ---------------------------------------------
    def optimizer_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler an optimizer prepared now steps through (made once per scope).

        Example:
            >>> precision_for("no").optimizer_scaler() is None
            True
        """
        return None

    def active_scaler(self) -> torch.amp.GradScaler | None:
        """The scope's GradScaler while this mode scales the loss, else ``None``.

        Example:
            >>> precision_for("bf16").active_scaler() is None
            True
        """
        return None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as ``backward`` backpropagates it (scaled by the GradScaler under fp16).

        Example:
            >>> precision_for("no").scale_loss(loss) is loss
            True
        """
        return loss

    def step(
        self, record: StepRecord, closure: Callable[[], float] | None, layouts: Layouts | None
    ) -> Any:
        """Step ``record.optimizer`` on a sync step (through the GradScaler under fp16).

        Args:
            record: the prepared optimizer.
            closure: passed to the user's ``step``.
            layouts: gradient layout grouping under an N-D mesh, else ``None``.

        Returns:
            What the user's ``step`` returned.

        Example:
            >>> precision_for("no").step(prepared, None, None)
        """
        if closure is None:
            return record.optimizer.step()
        return record.optimizer.step(closure)

    def unscale(self, optimizer: Any, record: StepRecord | None, layouts: Layouts | None) -> None:
        """Divide ``optimizer``'s scaled gradients by the loss scale (once per step when
        ``record``, its prepared optimizer, is given). Nothing to do without loss scaling.

        Example:
            >>> precision_for("no").unscale(optimizer, None, None)
        """

    def unscaled_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """A gradient norm taken before unscaling, in unscaled units.

        Example:
            >>> precision_for("no").unscaled_norm(torch.tensor(2.0))
            tensor(2.)
        """
        return norm

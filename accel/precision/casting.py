"""Autocast: ``accel.autocast()`` and the prepared forward (autocast in, fp32 floats out).

Both ask the unit of the state's mode (``accel.precision.registry``): ``"bf16"`` and
``"fp16"`` run under :func:`torch.autocast` on the state's device type (CPU and CUDA alike),
``"no"`` runs as written, ``"fp8"`` runs bf16 autocast around its float8 Linear layers
(``accel.precision.fp8``).
``prepare_model`` installs the forward wrapper with :func:`prepare_forward`; ``unwrap_model(m,
keep_fp32_wrapper=False)`` takes it off with :func:`remove_forward`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from accel.core.state import state
from accel.precision.registry import precision_for

__all__ = ["AutocastForward", "autocast", "outputs_to_fp32", "prepare_forward", "remove_forward"]

_REDUCED = (torch.float16, torch.bfloat16)
# AutocastForward's resolved policy: (policy, device, dtype, device type, autocast enabled)
_Plan = tuple[str, "torch.device | None", "torch.dtype | None", str, bool]


def autocast(
    *, enabled: bool = True, dtype: torch.dtype | None = None
) -> contextlib.AbstractContextManager[Any]:
    """Run the block under autocast, per the state's mixed precision policy.

    The state's mode decides (its unit's ``autocast``): with ``mixed_precision="no"`` (and no
    ``dtype``) this is a no-op context; otherwise :func:`torch.autocast` on the state's device
    type (``"cpu"`` or ``"cuda"``) with bf16 or fp16 (fp8: bf16, around its float8 layers).
    Prepared models already run their forward this way; use it for computation outside the
    model (a loss, a second head).

    Args:
        enabled: ``False`` turns autocast off inside the block (also inside a prepared
            model's forward, whose autocast is nested in it).
        dtype: override the dtype the policy would pick (e.g. ``torch.float16`` under bf16).

    Returns:
        A context manager.

    Example:
        >>> with accel.distributed(mixed_precision="bf16"):
        ...     with accel.autocast():
        ...         (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    st = state()
    return precision_for(st.mixed_precision).autocast(
        st.device.type, enabled=enabled, dtype=dtype
    )


def _to_fp32(value: Any) -> Any:
    """``value`` with fp16/bf16 tensors cast to fp32; the same object when none is reduced."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _REDUCED else value
    if isinstance(value, list | tuple):
        items = [_to_fp32(item) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value  # nothing to cast: no rebuilt containers
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return type(value)(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        converted = {key: _to_fp32(item) for key, item in value.items()}
        if all(converted[key] is item for key, item in value.items()):
            return value
        try:
            return type(value)(converted)  # keeps dict subclasses (e.g. ModelOutput)
        except TypeError:
            return converted
    return value


def outputs_to_fp32(outputs: Any) -> Any:
    """Cast every fp16/bf16 tensor in ``outputs`` (nested list/tuple/dict) to fp32.

    Other tensors (fp32, integers, fp64) and non-tensor leaves are returned as they are.

    Example:
        >>> outputs_to_fp32({"logits": torch.ones(2, dtype=torch.bfloat16)})["logits"].dtype
        torch.float32
    """
    return _to_fp32(outputs)


class AutocastForward:
    """A module's forward run under the state's autocast, with fp32 floating outputs.

    Installed once by ``prepare_model`` as the module's instance ``forward``; the original
    bound forward stays in :attr:`original` (``unwrap_model(m, keep_fp32_wrapper=False)``
    puts it back). The policy is read when the forward runs, so a nested
    ``with accel.distributed(mixed_precision="no"):`` block runs it in full precision. Inside
    a ``torch.compile`` region (``prepare_model(compile=True)``) the policy and device type
    captured at prepare time are used instead: reading the state's ContextVar there would
    break the graph.

    The autocast region is entered as :func:`torch.autocast` enters it (the same thread-local
    switches, set and restored, and the cast cache cleared when the outermost region ends),
    without building a ``torch.autocast`` object per call: the mode's unit
    (``forward_casting``) decides the dtype and runs torch's checks (device, dtype support)
    once per policy and device, when they are first seen. Under a torch function mode (e.g.
    ``torch.export`` tracing) a real ``torch.autocast`` is used, so the mode sees the region.
    Outputs that are already fp32 (or not floating) are returned as they are, containers
    included.

    Example:
        >>> with accel.distributed(mixed_precision="bf16"):
        ...     net = accel.prepare_model(nn.Linear(2, 2))
        ...     type(net.__dict__["forward"]).__name__
        'AutocastForward'
    """

    __slots__ = ("__wrapped__", "_plan", "device_type", "dtype", "instance_attribute", "original")

    def __init__(
        self,
        original: Callable[..., Any],
        *,
        instance_attribute: bool = False,
        dtype: torch.dtype | None = None,
        device_type: str = "cpu",
    ) -> None:
        self.original = original
        self.__wrapped__ = original
        self.instance_attribute = instance_attribute  # original was an instance attribute
        self.dtype = dtype  # the policy at prepare time (used while compiling)
        self.device_type = device_type
        # The last policy and device seen at call time and what they resolve to, in one
        # tuple (replaced whole, so a thread never sees half an update): see _resolve.
        self._plan: _Plan = ("", None, None, device_type, False)

    def _resolve(self, policy: str, device: torch.device) -> _Plan:
        """Ask the mode's unit (once per policy and device) what the region switches on."""
        dtype, enabled = precision_for(policy).forward_casting(device.type)
        plan: _Plan = (policy, device, dtype, device.type, enabled)
        self._plan = plan
        return plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._call_compiling(args, kwargs)
        st = state()
        policy, device = st.mixed_precision, st.device
        plan = self._plan
        if policy != plan[0] or device is not plan[1]:
            plan = self._resolve(policy, device)
        _, _, dtype, device_type, enabled = plan
        if dtype is None:
            return self.original(*args, **kwargs)
        if torch._C._is_torch_function_mode_enabled():  # e.g. export: let the mode see it
            with torch.autocast(device_type=device_type, dtype=dtype):
                outputs = self.original(*args, **kwargs)
        else:
            # torch.autocast.__enter__/__exit__, minus the object (cache_enabled unchanged).
            was_enabled = torch.is_autocast_enabled(device_type)
            was_dtype = torch.get_autocast_dtype(device_type)
            torch.set_autocast_enabled(device_type, enabled)
            torch.set_autocast_dtype(device_type, dtype)
            torch.autocast_increment_nesting()
            try:
                outputs = self.original(*args, **kwargs)
            finally:
                if torch.autocast_decrement_nesting() == 0:
                    torch.clear_autocast_cache()
                torch.set_autocast_enabled(device_type, was_enabled)
                torch.set_autocast_dtype(device_type, was_dtype)
        if isinstance(outputs, torch.Tensor):  # the common case, without the tree walk
            return outputs.float() if outputs.dtype in _REDUCED else outputs
        return _to_fp32(outputs)

    def _call_compiling(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The forward inside a ``torch.compile`` region: the prepare-time policy, traced."""
        if self.dtype is None:
            return self.original(*args, **kwargs)
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            outputs = self.original(*args, **kwargs)
        if isinstance(outputs, torch.Tensor):
            return outputs.float() if outputs.dtype in _REDUCED else outputs
        return _to_fp32(outputs)

    def __repr__(self) -> str:
        return f"AutocastForward({self.original!r})"


def prepare_forward(module: nn.Module) -> None:
    """Wrap ``module``'s forward in :class:`AutocastForward` once, if the state's mode casts.

    The wrapper goes in the module's ``__dict__`` (an instance ``forward``); a module already
    wrapped, or a mode whose unit has no forward dtype (``"no"``), is left as it is.

    Example:
        >>> with accel.distributed(mixed_precision="bf16"):
        ...     prepare_forward(net)
        ...     type(net.__dict__["forward"]).__name__
        'AutocastForward'
    """
    current = module.__dict__.get("forward")
    if isinstance(current, AutocastForward):
        return
    st = state()
    dtype = precision_for(st.mixed_precision).forward_dtype()
    if dtype is None:
        return
    module.__dict__["forward"] = AutocastForward(
        module.forward,
        instance_attribute=current is not None,
        dtype=dtype,
        device_type=st.device.type,
    )


def remove_forward(module: nn.Module) -> None:
    """Put back the forward :func:`prepare_forward` wrapped (in place); else do nothing.

    Example:
        >>> remove_forward(net)
        >>> "forward" in net.__dict__
        False
    """
    forward = module.__dict__.get("forward")
    if isinstance(forward, AutocastForward):
        if forward.instance_attribute:  # the user had set an instance forward: keep it
            module.__dict__["forward"] = forward.original
        else:
            del module.__dict__["forward"]

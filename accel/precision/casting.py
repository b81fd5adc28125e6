"""Mixed precision: the autocast policy and the fp32-output forward of prepared models.

The policy comes from ``accel.state().mixed_precision``: ``"bf16"`` and ``"fp16"`` run the
forward pass under :func:`torch.autocast` on the state's device type (CPU and CUDA alike);
``"no"`` runs it as written. ``"fp8"`` needs a dedicated backend (a later piece of work); until
then it runs the forward under bf16 autocast, the precision fp8 recipes keep outside matmuls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from accel.core.state import state
from accel.errors import ConfigError

if TYPE_CHECKING:
    from accel.core.settings import MixedPrecision

__all__ = ["AutocastForward", "autocast", "autocast_dtype", "outputs_to_fp32"]

_DTYPES: Mapping[str, torch.dtype | None] = {
    "no": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.bfloat16,
}
_REDUCED = (torch.float16, torch.bfloat16)
# AutocastForward's resolved policy: (policy, device, dtype, device type, autocast enabled)
_Plan = tuple[str, "torch.device | None", "torch.dtype | None", str, bool]


def autocast_dtype(mixed_precision: MixedPrecision | str) -> torch.dtype | None:
    """The dtype autocast uses for a mixed precision policy, or ``None`` for ``"no"``.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.

    Returns:
        ``torch.float16``, ``torch.bfloat16`` or ``None``.

    Raises:
        ConfigError: the policy is not one of the choices.

    Example:
        >>> autocast_dtype("bf16")
        torch.bfloat16
    """
    try:
        return _DTYPES[mixed_precision]
    except KeyError:
        raise ConfigError(
            f"mixed_precision={mixed_precision!r} is not supported; choose one of "
            f"{list(_DTYPES)}, e.g. `accel.distributed(mixed_precision='bf16')`."
        ) from None


def autocast(
    *, enabled: bool = True, dtype: torch.dtype | None = None
) -> contextlib.AbstractContextManager[Any]:
    """Run the block under autocast, per the state's mixed precision policy.

    With ``mixed_precision="no"`` (and no ``dtype``) this is a no-op context. Otherwise it is
    :func:`torch.autocast` on the state's device type (``"cpu"`` or ``"cuda"``) with bf16 or
    fp16. Prepared models already run their forward this way; use it for computation outside
    the model (a loss, a second head).

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
    if dtype is None:
        dtype = autocast_dtype(st.mixed_precision)
        if dtype is None:
            if enabled:
                return contextlib.nullcontext()
            # "no" policy, but the caller asks to switch autocast off (e.g. inside an
            # enclosing user autocast): honour it with the device's default dtype.
            return torch.autocast(device_type=st.device.type, enabled=False)
    return torch.autocast(device_type=st.device.type, dtype=dtype, enabled=enabled)


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
    without building a ``torch.autocast`` object per call: its checks (device, dtype support)
    run once per policy, when the policy is first seen. Under a torch function mode (e.g.
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
        """Work out (once per policy and device) what the autocast region switches on."""
        dtype = _DTYPES.get(policy)
        enabled = False
        if dtype is not None:
            # torch.autocast's own checks (device available, dtype supported), run once: it
            # raises for an unsupported device and warns and disables for an unusable dtype.
            enabled = bool(torch.autocast(device_type=device.type, dtype=dtype)._enabled)
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

"""Which unit serves each mixed precision mode: :data:`PRECISIONS` and :func:`precision_for`.

Adding a mode is one module in ``accel/precision/`` (a :class:`~accel.precision.base.Precision`
subclass) plus one entry here, and in the settings table (``accel.core.settings``, which
``distributed()`` checks without importing this package) its name among ``MixedPrecision``'s
choices and its options: a ``SETTINGS`` entry with ``mode=`` for one a file, an ``ACCEL_*``
variable or ``accel launch --<key>`` may give (``code=`` for what code may also give), a
``PRECISION_CODE_OPTIONS`` entry for one only code gives. Nothing else changes: ``distributed()``
checks the options generically and ``accel launch`` makes their flags from the table.
"""

from __future__ import annotations

from collections.abc import Mapping

from accel.errors import ConfigError
from accel.precision.base import Precision
from accel.precision.fp8 import Float8
from accel.precision.half import BFloat16, Float16

__all__ = ["PRECISIONS", "precision_for"]

# a plain dict (typed read-only): precision_for looks it up on every backward and step, and a
# MappingProxyType lookup costs more
PRECISIONS: Mapping[str, Precision] = {
    "no": Precision(),
    "fp16": Float16(),
    "bf16": BFloat16(),
    "fp8": Float8(),
}
"""Each ``mixed_precision`` mode and its unit (frozen and stateless: one instance serves every
block and thread)."""


def precision_for(mode: str) -> Precision:
    """The unit of a ``mixed_precision`` mode, e.g. of ``accel.state().mixed_precision``.

    Args:
        mode: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.

    Returns:
        The mode's :class:`~accel.precision.base.Precision`.

    Raises:
        ConfigError: the mode is not one of the choices.

    Example:
        >>> precision_for("bf16").dtype
        torch.bfloat16
    """
    try:
        return PRECISIONS[mode]
    except KeyError:
        raise ConfigError(
            f"mixed_precision={mode!r} is not supported; choose one of "
            f"{list(PRECISIONS)}, e.g. `accel.distributed(mixed_precision='bf16')`."
        ) from None

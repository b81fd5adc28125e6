"""Model weights: ``save`` / ``load`` of one object, ``save_model`` in the HF layout,
``get_state_dict`` (full weights of a sharded model), the weight files of a directory or an
index, and streaming weights into a model one tensor at a time.

Names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.core.lazy import lazy_names

_LAZY = {
    "get_state_dict": "accel.weights.model_io",
    "load": "accel.weights.model_io",
    "save": "accel.weights.model_io",
    "save_model": "accel.weights.model_io",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from accel.weights.model_io import get_state_dict as get_state_dict
    from accel.weights.model_io import load as load
    from accel.weights.model_io import save as save
    from accel.weights.model_io import save_model as save_model


__getattr__, __dir__ = lazy_names(__name__, _LAZY)

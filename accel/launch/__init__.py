"""Launching: the ``accel`` command (launch, config, env, test) and the notebook launchers.

``notebook_launcher`` and ``debug_launcher`` load on first use, so the command starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["debug_launcher", "notebook_launcher"]

if TYPE_CHECKING:
    from accel.launch.notebook import debug_launcher as debug_launcher
    from accel.launch.notebook import notebook_launcher as notebook_launcher


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("accel.launch.notebook"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'accel.launch' has no attribute {name!r}")

"""accel: run any PyTorch training script on one CPU, one GPU, many GPUs or many machines.

No central object: ``with accel.distributed(...):`` sets an immutable process state that plain
functions (``accel.prepare``, ``accel.backward``, ``accel.gather``...) read.

Importing accel is cheap: the submodules (and torch) load on first use of a name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from accel.errors import (
    AccelError,
    CheckpointError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    GatedCollectiveError,
    MainProcessFirstError,
    NotDistributedError,
    RemoteError,
)

__version__ = "0.1.0"

# public name -> module that defines it (loaded on first attribute access)
_LAZY: dict[str, str] = {
    "ProcessState": "accel._state",
    "state": "accel._state",
    "distributed": "accel.distributed",
    "on_main_process": "accel.gating",
    "on_local_main_process": "accel.gating",
    "on_last_process": "accel.gating",
    "on_process": "accel.gating",
    "on_local_process": "accel.gating",
    "main_process_first": "accel.gating",
    "local_main_process_first": "accel.gating",
    "print": "accel.gating",
    "get_logger": "accel.gating",
    "gather": "accel.collectives",
    "gather_object": "accel.collectives",
    "reduce": "accel.collectives",
    "broadcast": "accel.collectives",
    "broadcast_object": "accel.collectives",
    "pad_across_processes": "accel.collectives",
    "split_between_processes": "accel.collectives",
    "wait_for_everyone": "accel.collectives",
    "set_trigger": "accel.collectives",
    "check_trigger": "accel.collectives",
    "gather_for_metrics": "accel.metrics",
    "set_seed": "accel.seeding",
}

__all__ = [
    "AccelError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "GatedCollectiveError",
    "MainProcessFirstError",
    "NotDistributedError",
    "RemoteError",
    "__version__",
    *_LAZY,
]

if TYPE_CHECKING:
    from accel._state import ProcessState, state
    from accel.collectives import (
        broadcast,
        broadcast_object,
        check_trigger,
        gather,
        gather_object,
        pad_across_processes,
        reduce,
        set_trigger,
        split_between_processes,
        wait_for_everyone,
    )
    from accel.distributed import distributed
    from accel.gating import (
        get_logger,
        local_main_process_first,
        main_process_first,
        on_last_process,
        on_local_main_process,
        on_local_process,
        on_main_process,
        on_process,
        print,
    )
    from accel.metrics import gather_for_metrics
    from accel.seeding import set_seed


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""Capture and restore a process's random number generators, without pickle.

Python's ``random``, numpy's global generator (when numpy is installed), torch's CPU generator
and every CUDA device's generator. States become a JSON structure plus tensors (see
:mod:`accel._files.encode`).
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """Every generator's state as a nested value of tensors, numbers and lists.

    Example:
        >>> state = get_rng_state(); torch.rand(1); set_rng_state(state)
    """
    version, internal, gauss = random.getstate()
    states: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if _numpy_available():
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        states["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = list(torch.cuda.get_rng_state_all())
    return states


def set_rng_state(states: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured (generators it lacks are left alone)."""
    if "python" in states:
        py = states["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    if "torch" in states:
        torch.set_rng_state(states["torch"].to(torch.uint8))
    if "numpy" in states and _numpy_available():
        import numpy as np

        npy = states["numpy"]
        np.random.set_state(
            (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
             npy["cached_gaussian"])
        )
    if "cuda" in states and torch.cuda.is_available():
        cuda_states = states["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.to(torch.uint8) for s in cuda_states])


def _numpy_available() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True

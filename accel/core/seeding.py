"""Seeding every random number generator a training run uses."""

from __future__ import annotations

import random

import torch

from accel.core.state import state
from accel.errors import ConfigError

__all__ = ["set_seed"]

_MAX_SEED = 2**32 - 1  # numpy's limit; python and torch accept it too


def set_seed(seed: int, *, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed python's ``random``, numpy (if installed) and torch (CPU and every CUDA device).

    Args:
        seed: the seed, an integer in ``[0, 2**32 - 1]``.
        device_specific: add the process's global rank to the seed, so each rank draws
            different numbers (e.g. for data augmentation).
        deterministic: also make torch use deterministic algorithms
            (``torch.use_deterministic_algorithms(True)``, cuDNN deterministic and not
            benchmarking). On CUDA, deterministic cuBLAS needs the environment variable
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` set before the process starts.

    Raises:
        ConfigError: ``seed`` is not an integer in range.

    Example:
        >>> accel.set_seed(42)
        >>> accel.set_seed(42, device_specific=True)  # rank r uses 42 + r
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(
            f"seed={seed!r} must be an integer, e.g. `accel.set_seed(42)`."
        )
    if device_specific:
        seed += state().rank
    if not 0 <= seed <= _MAX_SEED:
        raise ConfigError(
            f"seed={seed!r} (rank offset included) must be in [0, {_MAX_SEED}], "
            "e.g. `accel.set_seed(42)`."
        )
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # every device: CPU, CUDA (all GPUs), MPS, XPU
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

"""Which of DeepSpeed's C++ ops a resolved config makes it compile, and the CPU default that
needs none.

DeepSpeed builds most of its kernels at first use (g++ and ninja on a CPU, nvcc on CUDA; about
3-4 minutes each, cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``),
unless its wheel was built with them. A build killed half way leaves a ``lock`` file behind and
the next run waits on it forever, without a word. So:

* :func:`prefer_torch_adam`: on a CPU, a config ``"optimizer"`` of type Adam/AdamW that does not
  say ``torch_adam`` gets ``torch_adam: true`` (torch's Adam/AdamW, the same update as
  DeepSpeed's CPU kernels) instead of a build; ``"torch_adam": false`` keeps DeepSpeed's.
* :func:`warn_builds`: every op the config still needs and the installed DeepSpeed lacks is
  named once, with the time it costs and how to avoid it; a stale lock of such an op is named
  too (delete it, or the run waits forever).
"""

from __future__ import annotations

import copy
import importlib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel.core.env import read_variable
from accel.core.once import first_time

__all__ = ["needed_ops", "prefer_torch_adam", "warn_builds"]

_ADAMS = ("adam", "adamw")


def _offloaded(config: Mapping[str, Any]) -> bool:
    zero = config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, Mapping) else None
    return isinstance(offload, Mapping) and str(offload.get("device", "none")) in ("cpu", "nvme")


def _optimizer(config: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any]]:
    section = config.get("optimizer")
    if not isinstance(section, Mapping):
        return None, {}
    params = section.get("params")
    return str(section.get("type", "")).lower(), params if isinstance(params, Mapping) else {}


def prefer_torch_adam(config: Mapping[str, Any], device_type: str) -> dict[str, Any]:
    """``config`` with ``torch_adam: true`` on a CPU config Adam/AdamW that leaves it unsaid.

    Example:
        >>> cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        >>> prefer_torch_adam(cfg, "cpu")["optimizer"]["params"]["torch_adam"]
        True
    """
    out = copy.deepcopy(dict(config))
    name, params = _optimizer(out)
    if device_type != "cpu" or name not in _ADAMS or "torch_adam" in params:
        return out
    section = out["optimizer"]
    section["params"] = {**params, "torch_adam": True}
    return out


def needed_ops(config: Mapping[str, Any], *, client_optimizer: bool) -> list[str]:
    """DeepSpeed's op names the resolved ``config`` makes ``deepspeed.initialize`` load.

    Example:
        >>> needed_ops({"optimizer": {"type": "Lamb"}}, client_optimizer=False)
        ['fused_lamb']
    """
    offloaded = _offloaded(config)
    ops: list[str] = []
    if client_optimizer:
        if offloaded and config.get("zero_force_ds_cpu_optimizer", True):
            ops.append("cpu_adam")  # DeepSpeed swaps its CPU Adam in for the torch optimizer
    else:
        name, params = _optimizer(config)
        if name in _ADAMS and not params.get("torch_adam", False):
            ops.append("cpu_adam" if offloaded else "fused_adam")
        elif name == "adagrad" and offloaded:
            ops.append("cpu_adagrad")
        elif name == "lamb":
            ops.append("fused_lamb")
        elif name == "lion":
            ops.append("cpu_lion" if offloaded else "fused_lion")
    zero = config.get("zero_optimization")
    if isinstance(zero, Mapping):
        for key in ("offload_optimizer", "offload_param"):
            section = zero.get(key)
            if isinstance(section, Mapping) and section.get("device") == "nvme":
                ops.append("async_io")
                break
    return ops


def _build_dir(op: str) -> Path:
    """Where torch's extension loader builds ``op`` (its rule, computed: never created)."""
    import sys

    own = read_variable("TORCH_EXTENSIONS_DIR")
    if own:
        return Path(own) / op
    torch = importlib.import_module("torch")
    extension = importlib.import_module("torch.utils.cpp_extension")
    if torch.version.hip is not None:
        tag = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        tag = "cu" + torch.version.cuda.replace(".", "")
    else:
        tag = "cpu"
    python = f"py{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}"
    return Path(extension.get_default_build_root()) / f"{python}_{tag}" / op


def warn_builds(config: Mapping[str, Any], *, client_optimizer: bool) -> list[str]:
    """Warn once per op (and block) that DeepSpeed will compile for ``config``; return those ops.

    Example:
        >>> warn_builds({}, client_optimizer=True)
        []
    """
    try:
        installed = dict(importlib.import_module("deepspeed.git_version_info").installed_ops)
    except (ImportError, AttributeError):
        installed = {}
    to_build = [op for op in needed_ops(config, client_optimizer=client_optimizer)
                if not installed.get(op, False)]
    for op in to_build:
        lock = _build_dir(op) / "lock"
        if not first_time((__name__, "op built", op)):
            continue
        if lock.exists():
            warnings.warn(
                f"DeepSpeed's C++ op {op!r} has a build lock at {lock} left by a build that was "
                "stopped; every run now waits on it forever. Delete that file (no build of it "
                "may be running) and start again.",
                RuntimeWarning, stacklevel=3,
            )
        else:
            warnings.warn(
                f"This DeepSpeed config makes DeepSpeed compile its C++ op {op!r} now (about 3-4 "
                "minutes, once per machine: it needs g++ and ninja, nvcc on CUDA; cached under "
                "TORCH_EXTENSIONS_DIR). To avoid it pass a torch optimizer to accel.prepare, or "
                "set \"torch_adam\": true in the config's optimizer params (Adam/AdamW), or "
                "install DeepSpeed with the op prebuilt (DS_BUILD_OPS=1).",
                RuntimeWarning, stacklevel=3,
            )
    return to_build

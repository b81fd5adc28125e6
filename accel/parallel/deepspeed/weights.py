"""Full weights of a model under DeepSpeed: ZeRO-3 partitions every parameter across the
ranks, so each one is gathered in turn (``deepspeed.zero.GatheredParameters``), onto the CPU.

The fp32 master weights and optimizer state by name (for checkpoints) are
:mod:`~accel.parallel.deepspeed.checkpoint`'s.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

__all__ = ["gathered_state_dict", "is_partitioned"]


def is_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitions (DeepSpeed marks them ``ds_id``).

    Example:
        >>> is_partitioned(nn.Linear(2, 2))
        False
    """
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every ZeRO-3 parameter gathered in full, on the CPU.

    Every rank must call it: one all-gather per parameter, in the module's order. Tied
    parameters are gathered once and their names share the result.

    Example:
        >>> sd = gathered_state_dict(engine.module)   # every rank
    """
    zero = importlib.import_module("deepspeed").zero
    full: dict[int, torch.Tensor] = {}
    for param in module.parameters():  # each parameter object once, in the module's order
        if id(param) in full:
            continue
        if hasattr(param, "ds_id"):
            with zero.GatheredParameters([param], modifier_rank=None):
                full[id(param)] = param.detach().to("cpu", copy=True)
        else:
            full[id(param)] = param.detach().to("cpu")
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        tensor = full.get(id(value))
        out[name] = tensor if tensor is not None else value.detach().to("cpu")
    return out

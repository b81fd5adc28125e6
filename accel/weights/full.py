"""Full weights of an FSDP (DTensor) model: gathered tensor by tensor, onto the CPU.

``get_state_dict`` gathers every tensor; ``save_model`` gathers one shard file's tensors at a
time (:func:`gather`), every rank taking part in each gather in the same order, so no rank holds
more than one file's worth of full tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from accel.core.tree import dtensor_type, holds_dtensors

__all__ = ["gather", "sharded_state"]


def sharded_state(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """``module.state_dict()`` (detached) when it holds DTensors, else ``None``.

    Example:
        >>> sharded_state(nn.Linear(2, 2)) is None
        True
    """
    if not holds_dtensors(module.parameters()):
        return None
    detached: dict[int, torch.Tensor] = {}  # tied names keep sharing one tensor
    return {
        k: detached.setdefault(id(v), v.detach())
        for k, v in module.state_dict(keep_vars=True).items()
    }


def gather(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor in full on the CPU: DTensors are all-gathered, in the mapping's order.

    A tensor object under several names (tied weights) is gathered once, and the names share
    the result, as they share the tensor in the model.

    Every rank must call it with the same keys in the same order (a collective per DTensor).

    Example:
        >>> full = gather(sharded_state(model))   # every rank
    """
    cls = dtensor_type()
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # a tensor under several names (tied) is gathered once
    for key, value in tensors.items():
        if id(value) not in done:
            full = (
                value.full_tensor()  # type: ignore[attr-defined]
                if cls is not None and isinstance(value, cls) else value
            )
            done[id(value)] = full.detach().to("cpu")
        out[key] = done[id(value)]
    return out

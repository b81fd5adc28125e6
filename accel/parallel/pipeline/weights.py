"""The full weights of a pipelined model: every stage's tensors, on every rank.

``accel.get_state_dict`` and ``accel.save_model`` give a pipelined model's full weights under
their global (unsplit) names: each stage's tensors (FSDP shards gathered within the stage
first) are gathered from every rank and put in the unsplit model's order.

Example:
    >>> full = all_stages(model, local)   # every rank
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from accel.parallel.pipeline.stages import pipeline_of

__all__ = ["all_stages"]


def all_stages(model: nn.Module, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's ``local`` tensors (full, on the CPU) merged, in the model's unit order.

    Every rank must call it (an all-gather of objects over the world).

    Example:
        >>> sorted(all_stages(stage1_model, {"head.weight": w}))[:2]
        ['head.bias', 'head.weight']
    """
    from accel.comm.collectives import gather_object

    pipe = pipeline_of(model)
    units = pipe.units if pipe is not None else ()
    merged: dict[str, torch.Tensor] = {}
    for part in gather_object({k: v.detach().cpu() for k, v in local.items()}):
        for key, value in part.items():
            merged.setdefault(key, value)

    def place(key: str) -> int:
        for number, unit in enumerate(units):
            if key.startswith(unit + "."):
                return number
        return len(units)

    order = {key: (place(key), n) for n, key in enumerate(merged)}
    return {key: merged[key] for key in sorted(merged, key=order.__getitem__)}

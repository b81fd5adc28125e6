"""The gradient norm of a pipelined model: every stage's norm combined over the ``pp`` dim.

Each stage holds different parameters, so the norm ``clip_grad_norm_`` returns is taken over
every stage's gradients (a sum of p-th powers, a max for the inf-norm, over the pipeline
group), after each stage's own norm is reduced over its FSDP shards; every rank clips with it.
A parameter tied across stages is counted once, on the rank owning it.

Example:
    >>> norm = clip_over_stages(list(model.parameters()), 1.0, 2.0, groups)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from accel.core.state import state

__all__ = ["clip_over_stages", "stage_norm"]


def _full(norm: torch.Tensor) -> torch.Tensor:
    full = getattr(norm, "full_tensor", None)
    if full is None or type(norm) is torch.Tensor:
        return norm
    value: torch.Tensor = full()
    return value


def clip_over_stages(
    params: list[Any], max_norm: float | None, norm_type: float, groups: list[list[Any]]
) -> torch.Tensor:
    """The total gradient norm over every stage (clipped to ``max_norm`` unless ``None``).

    ``groups`` are this rank's parameters with gradients grouped by mesh layout (plain
    tensors, FSDP DTensors); each group's norm is reduced over its own mesh first. Every rank
    must call it (an all-reduce over the pipeline group).

    Example:
        >>> clip_over_stages(params, None, 2.0, layout_groups(params))
        tensor(0.8123)
    """
    import torch.distributed as dist

    from accel.core.mesh import pp_mesh
    from accel.parallel.pipeline.ties import is_copy

    st = state()
    counted = [[p for p in group if not is_copy(p)] for group in groups]  # ties: once
    norms = [_full(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type))
             for group in counted if group]
    if norms:
        local = torch.linalg.vector_norm(torch.stack([n.to(st.device) for n in norms]),
                                         norm_type).float()
    else:
        local = torch.zeros((), device=st.device)
    group = pp_mesh(st.mesh).get_group()
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        powered = local.pow(norm_type)
        dist.all_reduce(powered, group=group)
        total = powered.pow(1.0 / norm_type)
    total = torch.as_tensor(total, dtype=torch.float32)
    if max_norm is not None:
        for layout in groups:
            torch.nn.utils.clip_grads_with_norm_(layout, max_norm, total)
    return total


def stage_norm(params: list[Any], max_norm: float | None, norm_type: float) -> torch.Tensor | None:
    """Under a ``pp`` dim, :func:`clip_over_stages` of ``params`` grouped by mesh layout;
    without one, ``None`` (the engine takes the norm over its own ranks).

    Example:
        >>> stage_norm(list(model.parameters()), 1.0, 2.0) is None   # no pipeline
        True
    """
    if state().pp_world_size == 1:
        return None
    from accel.parallel.fsdp_params import layout_groups

    return clip_over_stages(params, max_norm, norm_type, layout_groups(params))

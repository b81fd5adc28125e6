"""The cp group's collectives as autograd functions, each with its adjoint as its backward.

``_AllToAll`` exchanges sequence shards ``(B, H, S/C, D)`` for head shards ``(B, H/C, S, D)``
and back (attention), ``_SumOverGroup`` sums over the group (the loss of the whole batch) and
``_Gather`` puts every rank's piece together in rank order (a sequence gathered). Every rank of
the cp group calls them, in the same order.

Example:
    >>> group = _plan().group()
    >>> heads = _apply(_AllToAll, q, group, True)         # (B, H/C, S, D)
    >>> _apply(_AllToAll, heads, group, False).shape == q.shape
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []  # the package's own: attention, sharding and loss apply them


def _exchange(x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
    """All-to-all between ``(B, H, S/C, D)`` (sequence-sharded) and ``(B, H/C, S, D)``."""
    c = dist.get_world_size(group)
    if to_heads:
        b, h, s, d = x.shape
        send = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # [j]: rank j's piece, my heads
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)
    b, h, length, d = x.shape
    s = length // c
    send = x.reshape(b, h, c, s, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)  # [j]: rank j's heads, my piece
    return received.transpose(0, 1).reshape(b, c * h, s, d)


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` forward; the opposite exchange backward (its adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _exchange(x.contiguous(), group, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _exchange(grad.contiguous(), ctx.group, not ctx.to_heads), None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; all-reduce of the gradients backward (its adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _Gather(torch.autograd.Function):
    """Every rank's piece concatenated on ``dim`` in rank order; backward: the sum of every
    rank's gradient for this rank's piece."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.dim, ctx.piece, ctx.rank = group, dim, x.shape[dim], rank
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.narrow(ctx.dim, ctx.rank * ctx.piece, ctx.piece), None, None


def _apply(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    out: torch.Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
    return out

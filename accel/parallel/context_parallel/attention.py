"""Attention over the whole sequence for inputs holding this rank's piece of it.

``cp_method="alltoall"`` (Ulysses) exchanges the sequence for heads with an all-to-all around
plain SDPA (exact, any device and backend; the heads and key/value heads must divide by
``cp_size``); ``"ring"`` runs torch's ring attention (CUDA kernels). Your own attention modules
call :func:`sequence_parallel_attention`; a transformers model reaches the same code through
:mod:`accel.parallel.context_parallel.transformers`.

Example:
    >>> out = sequence_parallel_attention(q, k, v, is_causal=True)  # (B, H, S/C, D) in and out
"""

from __future__ import annotations

import torch

from accel.errors import ConfigError
from accel.parallel.context_parallel.autograd import _AllToAll, _apply
from accel.parallel.context_parallel.plan import _Plan, _plan

__all__ = ["sequence_parallel_attention"]


def _check_heads(heads: int, kv_heads: int, size: int) -> None:
    if heads % size or kv_heads % size:
        raise ConfigError(
            f"cp_method='alltoall' splits attention heads over cp_size={size}, but the model "
            f"has {heads} attention heads and {kv_heads} key/value heads, which {size} does not "
            "both divide. Choose a cp_size that divides both, or `cp_method='ring'` (CUDA)."
        )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool,
          scale: float | None, dropout_p: float) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key/value head serves a group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p
    )


def _ring(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool,
          scale: float | None, dropout_p: float) -> torch.Tensor:
    """torch's ring attention over the cp mesh (CUDA kernels; not testable on CPU)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import _attention as ring

    ring._enable_context_parallel_dispatcher()  # SDPA on DTensors sharded by sequence: ring
    ring._cp_options.enable_load_balance = True  # shard_sequence splits head-and-tail
    mesh = plan.mesh
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    q, k, v = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False)
               for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p
    )
    return out.to_local()  # type: ignore[no-any-return,attr-defined]


def _attention(plan: _Plan | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               is_causal: bool, scale: float | None, dropout_p: float) -> torch.Tensor:
    if plan is None:
        return _sdpa(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    if plan.method == "ring":
        return _ring(plan, q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    _check_heads(q.shape[1], k.shape[1], plan.size)
    group = plan.group()
    q, k, v = (_apply(_AllToAll, t, group, True) for t in (q, k, v))
    out = _sdpa(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p)
    return _apply(_AllToAll, out, group, False)


def sequence_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over the whole sequence for inputs holding this rank's piece of it.

    Takes and returns ``(batch, heads, local_sequence, head_dim)`` like
    :func:`torch.nn.functional.scaled_dot_product_attention` (key/value may have fewer heads,
    grouped-query attention), the pieces being what :func:`shard_sequence` gave this rank.
    Under ``cp_method="alltoall"`` heads are exchanged with two all-to-alls around SDPA; under
    ``"ring"`` torch's ring attention runs. Without a ``cp`` dim > 1 it is plain SDPA.
    Differentiable. Every rank of the cp group must call it, in the same order.

    Raises:
        ConfigError: (alltoall) heads or key/value heads that ``cp_size`` does not divide.

    Example:
        >>> class Attention(nn.Module):
        ...     def forward(self, x):                          # x: (B, S/C, E), this rank's piece
        ...         q, k, v = (p(x).unflatten(-1, (4, -1)).transpose(1, 2)
        ...                    for p in (self.q, self.k, self.v))
        ...         out = sequence_parallel_attention(q, k, v, is_causal=True)
        ...         return self.o(out.transpose(1, 2).flatten(2))
    """
    return _attention(_plan(), query, key, value, is_causal=is_causal, scale=scale,
                      dropout_p=dropout_p)

"""accumulate / no_sync / trigger_sync_in_backward reach a DDP wrapper inside torch.compile.

``prepare_model(model, compile=True)`` returns a compiled module wrapping the DDP wrapper: the
gradient-sync controls must look through it, or every micro-batch would all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import accel
from accel.testing import run_distributed


def _grads_per_rank(model: nn.Module) -> torch.Tensor:
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return accel.gather(local[None])


def _body() -> list[bool]:
    rank = accel.state().rank
    torch.manual_seed(0)
    compiled = accel.prepare_model(nn.Linear(4, 2), compile={"backend": "eager"})
    inner = compiled._orig_mod
    assert isinstance(inner, DistributedDataParallel)
    x = torch.full((3, 4), float(rank + 1))  # different data on each rank
    seen: list[bool] = []
    # accumulate: the first batch of a cycle of 2 keeps gradients local
    with accel.accumulate(compiled) as sync:
        assert not sync
        assert inner.require_backward_grad_sync is False
        accel.backward(compiled(x).sum())
    rows = _grads_per_rank(inner)
    seen.append(not torch.equal(rows[0], rows[1]))  # local: ranks differ
    with accel.accumulate(compiled) as sync:
        assert sync
        accel.backward(compiled(x).sum())
    rows = _grads_per_rank(inner)
    seen.append(torch.equal(rows[0], rows[1]))  # synced: ranks agree
    # no_sync + trigger_sync_in_backward through the compiled wrapper
    for p in inner.parameters():
        p.grad = None
    with accel.no_sync(compiled):
        assert inner.require_backward_grad_sync is False
        loss_a = compiled(x).sum()
        loss_b = compiled(2 * x).sum()
    accel.backward(loss_a)
    rows = _grads_per_rank(inner)
    seen.append(not torch.equal(rows[0], rows[1]))
    with accel.trigger_sync_in_backward(compiled):
        accel.backward(loss_b)
    rows = _grads_per_rank(inner)
    seen.append(torch.equal(rows[0], rows[1]))
    return seen


def test_gradient_sync_controls_reach_ddp_inside_compile() -> None:
    results = run_distributed(_body, world_size=2, gradient_accumulation_steps=2)
    assert results == [[True, True, True, True]] * 2

"""accel.LocalSGD on real processes (gloo, CPU), 2 and 3 ranks, each rank on its own data.

Checked: no gradient sync inside the block (gradients and parameters differ across ranks),
parameters identical on every rank right after each averaging step and at block exit and equal
to the mean of the ranks' parameters before it, accumulate inside the block, and
``enabled=False`` training exactly like plain DDP.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import accel
from accel.testing import run_distributed

FEATURES = 5


def _base_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, FEATURES, generator=generator), torch.randn(4, 2, generator=generator)


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's flattened ``tensors``, one row per rank (a collective)."""
    local = torch.cat([t.detach().reshape(-1) for t in tensors])
    return accel.gather(local[None])


def _param_rows(model: nn.Module) -> torch.Tensor:
    return _rows(list(model.parameters()))


def _grad_rows(model: nn.Module) -> torch.Tensor:
    return _rows([p.grad for p in model.parameters() if p.grad is not None])


def _same_rows(rows: torch.Tensor) -> bool:
    return all(torch.equal(rows[0], row) for row in rows)


def _assert_is_mean(after: torch.Tensor, before: torch.Tensor) -> None:
    assert _same_rows(after), "ranks differ right after averaging"
    torch.testing.assert_close(after[0], before.mean(0), rtol=0, atol=1e-6)


def _local_sgd_body(local_sgd_steps: int, steps: int, pass_original: bool) -> dict[str, Any]:
    rank = accel.state().rank
    net = _base_model()
    model, optimizer = accel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, DistributedDataParallel)
    generator = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    averaged_at: list[int] = []
    target = net if pass_original else model  # the original module resolves to its DDP
    with accel.LocalSGD(model=target, local_sgd_steps=local_sgd_steps) as local_sgd:
        assert local_sgd.enabled
        assert model.require_backward_grad_sync is False
        for index in range(steps):
            x, y = _batch(generator)
            accel.backward(nn.functional.mse_loss(model(x), y))
            assert not _same_rows(_grad_rows(model)), "gradients were synchronised"
            optimizer.step()
            optimizer.zero_grad()
            before = _param_rows(model)
            assert not _same_rows(before), "replicas should drift between averagings"
            local_sgd.step()
            after = _param_rows(model)
            if (index + 1) % local_sgd_steps == 0:
                averaged_at.append(index + 1)
                _assert_is_mean(after, before)
            else:
                assert torch.equal(after, before), "step() changed parameters off its period"
        before_exit = _param_rows(model)
        assert not _same_rows(before_exit)
    _assert_is_mean(_param_rows(model), before_exit)
    # after the block DDP synchronises gradients again
    assert model.require_backward_grad_sync is True
    x, y = _batch(generator)
    accel.backward(nn.functional.mse_loss(model(x), y))
    assert _same_rows(_grad_rows(model))
    return {"num_steps": local_sgd.num_steps, "averaged_at": averaged_at}


@pytest.mark.parametrize("world_size", [2, 3])
def test_local_sgd_averages_every_k_steps_and_at_exit(world_size: int) -> None:
    results = run_distributed(_local_sgd_body, 3, 7, world_size == 3, world_size=world_size)
    assert results == [{"num_steps": 7, "averaged_at": [3, 6]}] * world_size


def _accumulate_body(local_sgd_steps: int, batches: int) -> list[tuple[bool, bool, bool]]:
    rank = accel.state().rank
    net = _base_model()
    model, optimizer = accel.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(200 + rank)
    log: list[tuple[bool, bool, bool]] = []  # (sync step, optimizer stepped, averaged)
    with accel.LocalSGD(model=model, local_sgd_steps=local_sgd_steps) as local_sgd:
        for _ in range(batches):
            with accel.accumulate(model) as sync:
                x, y = _batch(generator)
                accel.backward(nn.functional.mse_loss(model(x), y))
                # accumulate's sync steps do not turn DDP's gradient sync back on
                assert model.require_backward_grad_sync is False
                assert not _same_rows(_grad_rows(model)), f"gradients synchronised (sync={sync})"
                start = [p.detach().clone() for p in model.parameters()]
                optimizer.step()  # the prepared optimizer steps on sync steps only
                optimizer.zero_grad()
                stepped = any(
                    not torch.equal(p, q) for p, q in zip(start, model.parameters(), strict=True)
                )
                before = _param_rows(model)
                local_sgd.step()
                after = _param_rows(model)
                averaged = local_sgd.num_steps % local_sgd_steps == 0
                if averaged:
                    _assert_is_mean(after, before)
                else:
                    assert torch.equal(after, before)
                log.append((sync, stepped, averaged))
        before_exit = _param_rows(model)
    _assert_is_mean(_param_rows(model), before_exit)
    assert model.require_backward_grad_sync is True
    return log


@pytest.mark.parametrize("world_size", [2, 3])
def test_local_sgd_with_accumulate_inside(world_size: int) -> None:
    results = run_distributed(
        _accumulate_body, 3, 8, world_size=world_size, gradient_accumulation_steps=2
    )
    expected = [((i + 1) % 2 == 0, (i + 1) % 2 == 0, (i + 1) % 3 == 0) for i in range(8)]
    assert results == [expected] * world_size


def _train_ddp(model: nn.Module, batches: int, local_sgd: accel.LocalSGD | None) -> bool:
    optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    generator = torch.Generator().manual_seed(300 + accel.state().rank)
    grads_synced = True
    for _ in range(batches):
        x, y = _batch(generator)
        accel.backward(nn.functional.mse_loss(model(x), y))
        grads_synced = grads_synced and _same_rows(_grad_rows(model))
        optimizer.step()
        optimizer.zero_grad()
        if local_sgd is not None:
            local_sgd.step()
        assert _same_rows(_param_rows(model))
    return grads_synced


def _disabled_body(batches: int) -> int:
    base = _base_model()
    plain = accel.prepare_model(copy.deepcopy(base))
    assert _train_ddp(plain, batches, None)
    model = accel.prepare_model(copy.deepcopy(base))
    with accel.LocalSGD(model=model, local_sgd_steps=2, enabled=False) as local_sgd:
        assert local_sgd.enabled is False
        assert model.require_backward_grad_sync is True
        assert _train_ddp(model, batches, local_sgd)
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), "enabled=False must train exactly like plain DDP"
    return local_sgd.num_steps


@pytest.mark.parametrize("world_size", [2, 3])
def test_disabled_local_sgd_trains_like_plain_ddp(world_size: int) -> None:
    assert run_distributed(_disabled_body, 5, world_size=world_size) == [5] * world_size


def _compiled_body() -> bool:
    # a compiled DDP model: LocalSGD finds the DDP wrapper inside and turns its sync off
    compiled = accel.prepare_model(_base_model(), compile={"backend": "eager"})
    inner = compiled._orig_mod
    assert isinstance(inner, DistributedDataParallel)
    with accel.LocalSGD(model=compiled, local_sgd_steps=2) as local_sgd:
        assert inner.require_backward_grad_sync is False
        with torch.no_grad():
            inner.module[0].bias.add_(float(accel.state().rank))  # replicas differ
        before = _param_rows(inner)
    _assert_is_mean(_param_rows(inner), before)
    return local_sgd.enabled and inner.require_backward_grad_sync


def test_compiled_ddp_model() -> None:
    assert run_distributed(_compiled_body, world_size=2) == [True, True]


class _Mixed(nn.Module):
    """Trainable fp32/bf16/complex parameters, a frozen parameter and float/int buffers."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        value = float(rank + 1)
        self.linear = nn.Linear(3, 2)
        self.low = nn.Parameter(torch.full((5,), value / 3, dtype=torch.bfloat16))
        self.cplx = nn.Parameter(torch.full((2,), complex(value, -value)))
        self.frozen = nn.Parameter(torch.full((2,), value), requires_grad=False)
        self.register_buffer("running", torch.full((3,), value))
        self.register_buffer("count", torch.tensor([rank + 10]))
        with torch.no_grad():
            self.linear.weight.fill_(value * 0.7)
            self.linear.bias.fill_(-value)


def _plain_module_body() -> None:
    rank, world = accel.state().rank, accel.state().world_size
    model = _Mixed(rank)  # not prepared: no DDP, its parameters are averaged all the same
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    everyone = {n: accel.gather(t[None]) for n, t in trainable.items()}
    with accel.LocalSGD(model=model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            rows = everyone[name]
            expected = rows.to(torch.float32).mean(0) if rows.dtype == torch.bfloat16 else None
            if expected is not None:  # summed in float32, rounded once
                assert torch.equal(param.detach(), expected.to(torch.bfloat16)), name
            else:
                torch.testing.assert_close(param.detach(), rows.mean(0), rtol=0, atol=1e-6)
            assert _same_rows(accel.gather(param.detach()[None]))
    # buffers and frozen parameters are left as they are
    assert torch.equal(model.frozen, torch.full((2,), float(rank + 1)))
    assert torch.equal(model.running, torch.full((3,), float(rank + 1)))
    assert torch.equal(model.count, torch.tensor([rank + 10]))
    assert model.count.dtype == torch.int64
    assert world > 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_only_trainable_parameters_are_averaged(world_size: int) -> None:
    run_distributed(_plain_module_body, world_size=world_size, debug=True)

"""Training through accel on real processes (gloo, CPU) equals single-process and raw DDP runs.

Batches are fed by hand: every rank builds the same global batches and takes its slice (rank
``r`` gets rows ``r*b:(r+1)*b``), the sharding a DistributedSampler-style loader gives.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.testing import run_distributed

PER_RANK = 3
FEATURES = 5


def _base_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


def _global_batches(count: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(count, world_size * PER_RANK, FEATURES, generator=generator)
    y = torch.randn(count, world_size * PER_RANK, 2, generator=generator)
    return x, y


def _local(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch[rank * PER_RANK : (rank + 1) * PER_RANK]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (p - q).abs().max().item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def _grads_equal_across_ranks(model: nn.Module) -> bool:
    local = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    everyone = accel.gather(local[None])
    return all(torch.equal(everyone[0], row) for row in everyone)


def _parity_body(optimizer_steps: int) -> dict[str, Any]:
    st = accel.state()
    rank, world, k = st.rank, st.world_size, st.gradient_accumulation_steps
    xs, ys = _global_batches(optimizer_steps * k, world)
    base = _base_model()

    # accel: the loop a user writes
    net = copy.deepcopy(base)
    model, optimizer = accel.prepare(net, _optimizer(net))
    assert isinstance(model, DistributedDataParallel)
    sync_flags: list[bool] = []
    local_grads_while_accumulating: list[bool] = []
    for index in range(len(xs)):
        with accel.accumulate(model) as sync:
            loss = nn.functional.mse_loss(model(_local(xs[index], rank)), _local(ys[index], rank))
            accel.backward(loss)
            sync_flags.append(sync)
            local_grads_while_accumulating.append(_grads_equal_across_ranks(model))
            optimizer.step()
            optimizer.zero_grad()
    assert sync_flags == [(i + 1) % k == 0 for i in range(len(xs))]
    # gradients are all-reduced exactly on sync steps (no_sync really skips the all-reduce)
    assert local_grads_while_accumulating == sync_flags

    # reference 1: one process, the concatenated global batch, mean over the k batches
    reference = copy.deepcopy(base)
    ref_optimizer = _optimizer(reference)
    for step in range(optimizer_steps):
        losses = [
            nn.functional.mse_loss(reference(xs[i]), ys[i])
            for i in range(step * k, (step + 1) * k)
        ]
        (sum(losses) / k).backward()  # type: ignore[operator]
        ref_optimizer.step()
        ref_optimizer.zero_grad()

    # reference 2: raw DDP with manual no_sync and loss / k
    raw = DistributedDataParallel(copy.deepcopy(base))
    raw_optimizer = _optimizer(raw.module)
    for index in range(len(xs)):
        last = (index + 1) % k == 0
        context = contextlib.nullcontext() if last else raw.no_sync()
        with context:
            out = raw(_local(xs[index], rank))
            loss = nn.functional.mse_loss(out, _local(ys[index], rank)) / k
            loss.backward()
        if last:
            raw_optimizer.step()
            raw_optimizer.zero_grad()

    trained = accel.unwrap_model(model)
    diffs = {"single": _max_diff(trained, reference), "ddp": _max_diff(trained, raw.module)}
    assert diffs["single"] <= 1e-6, diffs
    assert diffs["ddp"] <= 1e-6, diffs
    assert _max_diff(trained, base) > 1e-3  # it did train
    return diffs


def _parity_bodies(optimizer_steps: int, accumulations: tuple[int, ...]) -> list[Any]:
    results = []
    for steps in accumulations:
        with accel.distributed(gradient_accumulation_steps=steps):
            results.append(_parity_body(optimizer_steps))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_training_matches_single_process_and_raw_ddp(world_size: int) -> None:
    """With and without gradient accumulation (1 and 3 batches per step), atol 1e-6."""
    results = run_distributed(_parity_bodies, 4, (1, 3), world_size=world_size)
    assert len(results) == world_size
    for per_rank in results:
        assert len(per_rank) == 2


def _mixed_precision_body() -> dict[str, Any]:
    st = accel.state()
    rank, world = st.rank, st.world_size
    xs, ys = _global_batches(4, world)
    out: dict[str, Any] = {}

    # bf16 forward through DDP: reduced inside, fp32 out
    with accel.distributed(mixed_precision="bf16"):
        model = accel.prepare_model(_base_model())
        assert isinstance(model, DistributedDataParallel)
        out["bf16_dtype"] = str(model(_local(xs[0], rank)).dtype)

    # fp16: an overflow on one rank reaches every rank through the all-reduce: all skip the
    # optimizer step and the scheduler step, together.
    with accel.distributed(mixed_precision="fp16"):
        net = _base_model()
        raw_optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(raw_optimizer, lambda s: 1.0 / (1 + s))
        model, optimizer, scheduler = accel.prepare(net, raw_optimizer, scheduler)
        skipped = []
        for index in range(3):
            x = _local(xs[index], rank)
            if index == 1 and rank == 0:
                x = x * 1e6  # overflows fp16 in the forward: inf gradients, all-reduced
            loss = nn.functional.mse_loss(model(x), _local(ys[index], rank))
            accel.backward(loss * 1e-3)
            accel.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            skipped.append(accel.optimizer_step_was_skipped(optimizer))
        out["skipped"] = skipped
        out["scheduler_epoch"] = scheduler.last_epoch  # world_size per real step
        out["weights"] = [p.detach().clone() for p in accel.unwrap_model(model).parameters()]

    # trigger_sync_in_backward: two forwards under no_sync, the second backward all-reduces
    base = _base_model()
    ddp = accel.prepare_model(copy.deepcopy(base))
    with accel.no_sync(ddp):
        loss_a = nn.functional.mse_loss(ddp(_local(xs[0], rank)), _local(ys[0], rank))
        loss_b = nn.functional.mse_loss(ddp(_local(xs[1], rank)), _local(ys[1], rank))
    accel.backward(loss_a)
    assert not _grads_equal_across_ranks(ddp)
    with accel.trigger_sync_in_backward(ddp):
        accel.backward(loss_b)
    assert _grads_equal_across_ranks(ddp)
    reference = copy.deepcopy(base)
    (
        nn.functional.mse_loss(reference(xs[0]), ys[0])
        + nn.functional.mse_loss(reference(xs[1]), ys[1])
    ).backward()
    out["trigger_diff"] = max(
        (p.grad - q.grad).abs().max().item()  # type: ignore[operator]
        for p, q in zip(accel.unwrap_model(ddp).parameters(), reference.parameters(), strict=True)
    )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_precision_skips_and_triggered_sync(world_size: int) -> None:
    results = run_distributed(_mixed_precision_body, world_size=world_size)
    for result in results:
        assert result["bf16_dtype"] == "torch.float32"
        assert result["skipped"] == [False, True, False]
        assert result["scheduler_epoch"] == 2 * world_size
        assert result["trigger_diff"] <= 1e-6
    for p, q in zip(results[0]["weights"], results[-1]["weights"], strict=True):
        assert torch.equal(p, q)  # every rank took (and skipped) the same steps


def _loader_body(rounds: int, epochs: int, split: bool) -> dict[str, Any]:
    """A prepared loader drives accumulate: sync every k batches and on each epoch's last."""
    st = accel.state()
    world, k = st.world_size, st.gradient_accumulation_steps
    global_batch = world * PER_RANK
    xs, ys = _global_batches(rounds, world)
    dataset = TensorDataset(xs.reshape(-1, FEATURES), ys.reshape(-1, 2))
    base = _base_model()

    net = copy.deepcopy(base)
    raw_optimizer = _optimizer(net)
    schedule = torch.optim.lr_scheduler.LambdaLR(raw_optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    if split:  # each global batch is cut in world_size slices
        loader: Any = accel.prepare_data_loader(
            DataLoader(dataset, batch_size=global_batch), split_batches=True
        )
    else:  # batch i goes to rank i % world_size
        loader = DataLoader(dataset, batch_size=PER_RANK)
    model, optimizer, loader, scheduler = accel.prepare(net, raw_optimizer, loader, schedule)
    flags: list[bool] = []
    for _ in range(epochs):
        for x, y in loader:
            with accel.accumulate(model) as sync:
                accel.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            flags.append(sync)
    per_epoch = [(i + 1) % k == 0 or i == rounds - 1 for i in range(rounds)]
    assert flags == per_epoch * epochs, flags
    real_steps = sum(flags)
    assert scheduler.last_epoch == real_steps * (1 if split else world)

    # one process: the original loader with the global batch, the same sync pattern,
    # the scheduler stepped once per global step
    reference = copy.deepcopy(base)
    ref_optimizer = _optimizer(reference)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(
        ref_optimizer, lambda s: 1.0 / (1 + 0.1 * s)
    )
    for _ in range(epochs):
        for index, (x, y) in enumerate(DataLoader(dataset, batch_size=global_batch)):
            (nn.functional.mse_loss(reference(x), y) / k).backward()
            if per_epoch[index]:
                ref_optimizer.step()
                for _ in range(1 if split else world):
                    ref_schedule.step()
                ref_optimizer.zero_grad()
    diff = _max_diff(accel.unwrap_model(model), reference)
    assert diff <= 1e-6, diff
    assert scheduler.get_last_lr() == ref_schedule.get_last_lr()
    return {"steps": real_steps, "diff": diff}


def _loader_bodies(rounds: int, epochs: int) -> list[int]:
    return [_loader_body(rounds, epochs, split)["steps"] for split in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_prepared_loader_drives_accumulation(world_size: int) -> None:
    results = run_distributed(
        _loader_bodies, 5, 2, world_size=world_size, gradient_accumulation_steps=2
    )
    assert results == [[6, 6]] * world_size

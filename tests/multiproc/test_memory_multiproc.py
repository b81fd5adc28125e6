"""find_executable_batch_size and join_uneven_inputs on 2 and 3 real processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import accel
from accel.memory import OtherRankFailedError
from accel.testing import run_distributed


def _search_body() -> dict[str, Any]:
    st = accel.state()
    out: dict[str, Any] = {}
    tried: list[int] = []
    # simulated OOM: the last rank fits 16, rank 0 fits 32, the others fit everything
    limit = 16 if st.is_last_process else 32 if st.is_main_process else 1 << 20

    @accel.find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, offset: int) -> int:
        tried.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (rank {st.rank})")
        return batch_size + offset

    out["result"] = train(1000)
    out["tried"] = list(tried)
    out["again"] = train(0)  # the next call starts from the agreed size
    # a non-OOM error on one rank: it re-raises its own error, the others stop too
    failing: list[int] = []

    @accel.find_executable_batch_size(starting_batch_size=8)
    def flaky(batch_size: int) -> int:
        failing.append(batch_size)
        if st.rank == 1 and batch_size == 4:
            raise KeyError("bad batch on rank 1")
        if st.is_main_process and batch_size == 8:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return batch_size

    try:
        flaky()
        out["flaky"] = "returned"
    except (KeyError, OtherRankFailedError) as exc:
        out["flaky"] = f"{type(exc).__name__}: {exc}"
    out["flaky_tried"] = failing
    accel.wait_for_everyone()
    return out


@pytest.mark.slow  # a spawn plus a garbage collection per attempt on every rank
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_tries_the_same_sizes(world_size: int) -> None:
    results = run_distributed(_search_body, world_size=world_size)
    for r in results:
        assert r["tried"] == [128, 64, 32, 16]  # same sequence; first size that fits all
        assert r["result"] == 1016
        assert r["again"] == 16
        assert r["flaky_tried"] == [8, 4]
    assert results[1]["flaky"] == "KeyError: 'bad batch on rank 1'"
    for rank in (0, *range(2, world_size)):
        assert results[rank]["flaky"].startswith("OtherRankFailedError: Rank(s) [1] raised")


def _join_body() -> dict[str, Any]:
    st = accel.state()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.ones(2, 4) * (i + 1) for i in range(2 + 2 * st.rank)]  # uneven per rank
    seen = 0
    with accel.join_uneven_inputs([model], even_batches=False):
        for batch in batches:
            optimizer.zero_grad()
            model(batch).sum().backward()
            optimizer.step()
            seen += 1
    accel.wait_for_everyone()
    weights = accel.gather(model.module.weight.detach().reshape(1, -1))
    return {"seen": seen, "in_sync": bool((weights == weights[0]).all())}


@pytest.mark.slow  # a spawn plus DDP set-up on every rank
@pytest.mark.parametrize("world_size", [2, 3])
def test_join_uneven_inputs_with_ddp(world_size: int) -> None:
    results = run_distributed(_join_body, world_size=world_size, timeout=60)
    assert [r["seen"] for r in results] == [2 + 2 * r for r in range(world_size)]
    assert all(r["in_sync"] for r in results)  # the joined ranks shadowed the all-reduces

"""find_executable_batch_size and join_uneven_inputs on 2 and 3 real processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.errors import OtherRankFailedError
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
    out: dict[str, Any] = {"seen": seen, "in_sync": bool((weights == weights[0]).all())}
    # a prepared loader follows the block's even_batches: no padded samples inside it
    loader = accel.prepare_data_loader(DataLoader(TensorDataset(torch.arange(7.0)), batch_size=2))
    out["padded"] = [x.tolist() for (x,) in loader]
    with accel.join_uneven_inputs([model], even_batches=False):
        out["joined"] = []
        for (x,) in loader:
            model(x.reshape(-1, 1).expand(-1, 4)).sum().backward()
            out["joined"].append(x.tolist())
    out["after"] = [x.tolist() for (x,) in loader]
    out["even_batches"] = loader.even_batches
    return out


@pytest.mark.slow  # a spawn plus DDP set-up on every rank
@pytest.mark.parametrize("world_size", [2, 3])
def test_join_uneven_inputs_with_ddp(world_size: int) -> None:
    results = run_distributed(_join_body, world_size=world_size, timeout=60)
    assert [r["seen"] for r in results] == [2 + 2 * r for r in range(world_size)]
    assert all(r["in_sync"] for r in results)  # the joined ranks shadowed the all-reduces
    joined = sorted(v for r in results for batch in r["joined"] for v in batch)
    assert joined == [float(v) for v in range(7)]  # every sample once, no padding
    padded = [len(r["padded"]) for r in results]
    assert len(set(padded)) == 1  # outside the block: even batches (padded)
    assert sum(len(batch) for r in results for batch in r["padded"]) > 7
    assert all(r["after"] == r["padded"] and r["even_batches"] for r in results)  # restored

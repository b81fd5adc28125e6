"""gather_for_metrics on one process keeps the same samples as on N processes: the last batch
is cut to its real sample count (the HF ``no_trainer`` ``loss.repeat(batch_size)`` pattern)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import accel
import accel.comm.metrics as metrics
from accel.comm.metrics import gather_for_metrics
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.core.tree import zip_map_tensors
from accel.data import prepare_data_loader

N, BATCH = 37, 32


def loader(**options: Any) -> DataLoader[Any]:
    dataset = TensorDataset(torch.arange(N, dtype=torch.float32))
    return DataLoader(dataset, batch_size=BATCH, **options)


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(N, dtype=torch.float32))


def test_repeat_pattern_counts_each_sample_once() -> None:
    with accel.distributed():
        prepared = accel.prepare_data_loader(loader())
        losses = []
        for (batch,) in prepared:
            loss = (batch * 0.5).mean()
            losses.append(accel.gather_for_metrics(loss.repeat(BATCH)))
    assert [len(part) for part in losses] == [32, 5]
    assert sum(len(part) for part in losses) == N


@pytest.mark.parametrize("shuffle", [False, True])
def test_plain_pattern_is_the_dataset(shuffle: bool) -> None:
    with accel.distributed():
        prepared = accel.prepare_data_loader(loader(shuffle=shuffle))
        seen = [accel.gather_for_metrics(batch) for (batch,) in prepared]
    values = torch.cat(seen).tolist()
    assert len(values) == N
    assert sorted(values) == list(range(N))


def test_iterable_dataset_last_batch_is_cut() -> None:
    with accel.distributed():
        prepared = accel.prepare_data_loader(DataLoader(Stream(), batch_size=BATCH))
        counts = [len(accel.gather_for_metrics(batch.repeat(2)[:BATCH])) for batch in prepared]
    assert counts == [32, 5]


def test_drop_last_keeps_full_batches() -> None:
    with accel.distributed():
        prepared = accel.prepare_data_loader(loader(drop_last=True))
        counts = [len(accel.gather_for_metrics(batch.repeat(2))) for (batch,) in prepared]
    assert counts == [32]  # the one full batch; a 64-row output is cut to its 32 samples


def test_nested_tensors_scalars_and_objects() -> None:
    with accel.distributed():
        prepared = accel.prepare_data_loader(loader())
        outs = []
        for (batch,) in prepared:
            n = len(batch)
            outs.append(accel.gather_for_metrics({
                "x": batch.repeat(2),
                "m": batch.reshape(-1, 1).repeat(2, 3),
                "loss": batch.sum(),
                "names": [f"s{int(i)}" for i in batch.repeat(2)],
                "tag": "eval",
            }))
    last = outs[-1]
    assert n == 5
    assert last["x"].tolist() == list(range(32, 37))
    assert last["m"].shape == (5, 3)
    assert last["loss"].ndim == 0  # one value per process: not cut
    assert last["names"] == [f"s{i}" for i in range(32, 37)]
    assert last["tag"] == "eval"
    assert len(outs[0]["names"]) == 64  # not the last batch: untouched


def test_tensor_structures_are_cut_leaf_by_leaf() -> None:
    with accel.distributed():
        prepared = accel.prepare_data_loader(loader())
        outs = [accel.gather_for_metrics((b.repeat(2), [b.reshape(-1, 1)])) for (b,) in prepared]
    first, (second,) = outs[-1]
    assert first.tolist() == list(range(32, 37))
    assert second.flatten().tolist() == list(range(32, 37))


def test_use_gather_object_cuts_sample_lists() -> None:
    with accel.distributed():
        prepared = accel.prepare_data_loader(loader())
        outs = [
            accel.gather_for_metrics(list(batch.repeat(2)), use_gather_object=True)
            for (batch,) in prepared
        ]
    assert [len(o) for o in outs] == [64, 5]


def test_outside_a_loader_returns_the_data() -> None:
    data = {"x": torch.arange(40), "names": ["a"] * 40}
    with accel.distributed():
        assert accel.gather_for_metrics(data) is data


@pytest.mark.parametrize("world", [1, 2])
def test_same_count_on_one_and_two_processes(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """The repeat pattern gives 37 rows on 1 process and on 2 (ranks simulated)."""
    per_rank = []
    for rank in range(world):
        with set_state(ProcessState(rank=rank, world_size=world, seed=1), Scope()):
            per_rank.append([b.repeat(BATCH // len(b) + 1)[:BATCH]
                             for (b,) in prepare_data_loader(loader())])
    calls = iter(range(10**6))

    def fake_gather(data: Any) -> Any:
        i = next(calls)
        return zip_map_tensors(lambda *ts: torch.cat(ts), *[p[i] for p in per_rank])

    monkeypatch.setattr(metrics, "gather", fake_gather)
    with set_state(ProcessState(rank=0, world_size=world, seed=1), Scope()):
        rows = [gather_for_metrics(torch.ones(BATCH)) for _ in prepare_data_loader(loader())]
    assert sum(len(r) for r in rows) == N

"""Prepared loaders and gather_for_metrics on 2 and 3 real processes over gloo."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset, IterableDataset

import accel
from accel.comm.metrics import gather_for_metrics
from accel.data import prepare_data_loader
from accel.errors import ConfigError, RemoteError
from accel.testing import run_distributed


class Counting(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loaded += 1
        return index


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def _epoch(loader: Any) -> tuple[list[int], list[str]]:
    """One epoch through gather_for_metrics: tensors (nested) and plain objects."""
    tensors: list[int] = []
    names: list[str] = []
    for batch in loader:
        out = gather_for_metrics({"x": batch, "sq": [batch * batch]})
        assert out["sq"][0].tolist() == [v * v for v in out["x"].tolist()]
        tensors += out["x"].tolist()
        names += gather_for_metrics([f"s{i}" for i in batch.tolist()])
    return tensors, names


def _variable_batches(n: int) -> list[list[int]]:
    batches, start, size = [], 0, 1
    while start < n:
        batches.append(list(range(start, min(n, start + size))))
        start += size
        size = size % 4 + 1
    return batches


def _epochs_body() -> dict[str, Any]:
    world = accel.state().world_size
    uneven_n = (2 * world - 1) * 4 + 2  # every rank gets 2 batches; the last ones differ
    cases: dict[str, tuple[DataLoader[Any], dict[str, Any], int]] = {
        "even": (DataLoader(range(23), batch_size=3), {}, 23),
        "tiny": (DataLoader(range(2), batch_size=3), {}, 2),
        "split": (DataLoader(range(23), batch_size=2 * world), {"split_batches": True}, 23),
        "drop_last": (DataLoader(range(23), batch_size=3, drop_last=True), {},
                      (23 // 3 // world) * world * 3),
        "uneven": (DataLoader(range(uneven_n), batch_size=4), {"even_batches": False},
                   uneven_n),
        "variable": (DataLoader(range(17), batch_sampler=_variable_batches(17)), {}, 17),
        "stream": (DataLoader(Stream(23), batch_size=3), {"dispatch_batches": False}, 23),
        "stream_split": (DataLoader(Stream(23), batch_size=world),
                         {"dispatch_batches": False, "split_batches": True}, 23),
        "dispatch_stream": (DataLoader(Stream(23), batch_size=3), {}, 23),
        "dispatch_map": (DataLoader(range(23), batch_size=3), {"dispatch_batches": True}, 23),
        "dispatch_split": (DataLoader(range(23), batch_size=world),
                           {"dispatch_batches": True, "split_batches": True}, 23),
    }
    results: dict[str, Any] = {}
    for name, (loader, options, expected) in cases.items():
        prepared = prepare_data_loader(loader, **options)
        tensors, names = _epoch(prepared)
        results[name] = (
            tensors == list(range(expected)),
            names == [f"s{i}" for i in range(expected)],
        )
    # mixed outputs (tensors and objects) and use_gather_object, on padded last rounds
    mixed: list[int] = []
    mixed_names: list[str] = []
    forced: list[int] = []
    for batch in prepare_data_loader(DataLoader(range(13), batch_size=2)):
        out = gather_for_metrics({"x": batch, "names": [f"s{i}" for i in batch.tolist()]})
        mixed += out["x"].tolist()
        mixed_names += out["names"]
        forced += gather_for_metrics(batch, use_gather_object=True).tolist()
    results["mixed"] = (mixed == list(range(13)), mixed_names == [f"s{i}" for i in range(13)])
    results["use_gather_object"] = (forced == list(range(13)), True)
    return results


def _shuffle_and_dispatch_body() -> dict[str, Any]:
    rank = accel.state().rank
    loader = prepare_data_loader(DataLoader(range(30), batch_size=2, shuffle=True))
    orders = [_epoch(loader)[0] for _ in range(2)]
    counted = Counting(20)
    dispatched = prepare_data_loader(DataLoader(counted, batch_size=2), dispatch_batches=True)
    whole = [batch.tolist() for batch in dispatched]
    loaded_whole = counted.loaded
    dispatched.load_state_dict({"epoch": 0, "batches_yielded": 2})
    counted.loaded = 0
    resumed = [batch.tolist() for batch in dispatched]
    strings = DataLoader(range(8), batch_size=2, collate_fn=lambda items: [str(i) for i in items])
    try:
        list(prepare_data_loader(strings, dispatch_batches=True))
        error = "none"
    except (ConfigError, RemoteError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {
        "error": error,
        "orders": orders,
        "mine": whole,
        "loaded": (loaded_whole, counted.loaded),
        "resumed_ok": resumed == whole[2:],
        "rank": rank,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_gather_for_metrics_returns_the_dataset(world_size: int) -> None:
    for results in run_distributed(_epochs_body, world_size=world_size):
        failed = {name: ok for name, ok in results.items() if ok != (True, True)}
        assert not failed


@pytest.mark.parametrize("world_size", [2, 3])
def test_shuffle_agrees_across_ranks_and_dispatch(world_size: int) -> None:
    results = run_distributed(_shuffle_and_dispatch_body, world_size=world_size)
    first = results[0]["orders"]
    for result in results:
        assert result["orders"] == first  # every rank saw the same permutation
    assert sorted(first[0]) == list(range(30))
    assert first[0] != first[1]  # a new shuffle each epoch
    assert first[0] != list(range(30))
    for result in results:
        expected = "ConfigError" if result["rank"] == 0 else "RemoteError"
        assert result["error"].startswith(expected)  # raised on every rank, no hang
        assert "broadcasts tensors" in result["error"]
        assert result["resumed_ok"]
        if result["rank"] == 0:
            assert result["loaded"][0] == 20
            # resuming at round 2 skips round 1 unread; round 0 is read to pad the last round
            assert result["loaded"][1] == 20 - 1 * world_size * 2
        else:
            assert result["loaded"] == (0, 0)  # only rank 0 reads when dispatching
    mine = {i for result in results for batch in result["mine"] for i in batch}
    assert mine == set(range(20))  # the dispatched slices cover the dataset

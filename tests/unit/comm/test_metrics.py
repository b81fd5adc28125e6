"""gather_for_metrics: trimming and merging rules, and a whole epoch with simulated ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel.comm.metrics as metrics
from accel.comm.metrics import FinalRound, gather_for_metrics, merge_gathered_objects, trim_gathered
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.core.tree import zip_map_tensors
from accel.data import prepare_data_loader


@pytest.mark.parametrize(
    ("final", "gathered", "expected"),
    [
        (FinalRound(sizes=(3, 3), real=(3, 0)), [18, 19, 20, 0, 1, 2], [18, 19, 20]),
        (FinalRound(sizes=(3, 3), real=(3, 1)), [18, 19, 20, 21, 0, 1], [18, 19, 20, 21]),
        (FinalRound(sizes=(2, 2, 2), real=(1, 1, 0)), [8, 0, 9, 1, 2, 3], [8, 9]),
        (FinalRound(sizes=(4, 1), real=(4, 1)), [0, 1, 2, 3, 4, -1, -1, -1], [0, 1, 2, 3, 4]),
        (FinalRound(sizes=(2, 2), real=(2, 2)), [0, 1, 2, 3], [0, 1, 2, 3]),
    ],
)
def test_trim_gathered(final: FinalRound, gathered: list[int], expected: list[int]) -> None:
    rows = len(gathered) // len(final.real)
    result = trim_gathered(torch.zeros(rows), torch.tensor(gathered), final)
    assert result.tolist() == expected


def test_trim_gathered_nested_and_scalars() -> None:
    final = FinalRound(sizes=(2, 2), real=(2, 1))
    original = {"x": torch.zeros(2, 3), "loss": torch.tensor(1.0), "n": [torch.zeros(2)]}
    gathered = {"x": torch.arange(12).reshape(4, 3), "loss": torch.tensor([1.0, 2.0]),
                "n": [torch.tensor([5, 6, 7, 8])]}
    out = trim_gathered(original, gathered, final)
    assert out["x"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert out["loss"].tolist() == [1.0, 2.0]  # one value per rank: untouched
    assert out["n"][0].tolist() == [5, 6, 7]
    assert trim_gathered(torch.zeros(2), torch.arange(4), None, prefix=3).tolist() == [0, 1, 2]
    assert trim_gathered(torch.zeros(2), torch.arange(4), None).tolist() == [0, 1, 2, 3]


def test_merge_gathered_objects() -> None:
    assert merge_gathered_objects([["a", "b"], ["c", "a"]], (2, 1)) == ["a", "b", "c"]
    assert merge_gathered_objects([("a",), ("b",)]) == ["a", "b"]
    merged = merge_gathered_objects(
        [{"ids": ["a", "b"], "p": torch.tensor([1, 2])},
         {"ids": ["c", "x"], "p": torch.tensor([3, 0])}], (2, 1),
    )
    assert merged["ids"] == ["a", "b", "c"]
    assert merged["p"].tolist() == [1, 2, 3]
    assert merge_gathered_objects([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]
    assert merge_gathered_objects([3, 4]) == [3, 4]  # one value per rank


def test_single_process_returns_the_data() -> None:
    data = {"x": torch.arange(3), "names": ["a", "b", "c"]}
    with set_state(ProcessState(), Scope()):
        assert gather_for_metrics(data) is data
        loader = prepare_data_loader(DataLoader(range(5), batch_size=2))
        assert [gather_for_metrics(b).tolist() for b in loader] == [[0, 1], [2, 3], [4]]


def simulate_epoch(
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    make: Callable[[], Any],
    output: Callable[[Any], Any],
    **options: Any,
) -> dict[int, list[Any]]:
    """Every rank's gather_for_metrics results over an epoch; gathers answered from the
    other ranks' batches of the same round (what the collectives would return)."""
    per_rank = []
    for rank in range(world):
        with set_state(ProcessState(rank=rank, world_size=world, seed=1), Scope()):
            per_rank.append([output(b) for b in prepare_data_loader(make(), **options)])
    results: dict[int, list[Any]] = {}
    for rank in range(world):
        calls = iter(range(10**6))

        def fake_gather(data: Any, calls: Any = calls) -> Any:
            i = next(calls)
            return zip_map_tensors(lambda *ts: torch.cat(ts), *[p[i] for p in per_rank])

        def fake_gather_object(obj: Any, calls: Any = calls) -> list[Any]:
            i = next(calls)
            return [p[i] for p in per_rank]

        monkeypatch.setattr(metrics, "gather", fake_gather)
        monkeypatch.setattr(metrics, "gather_object", fake_gather_object)
        with set_state(ProcessState(rank=rank, world_size=world, seed=1), Scope()):
            loader = prepare_data_loader(make(), **options)
            results[rank] = [gather_for_metrics(output(b)) for b in loader]
    return results


CASES = [  # (n, batch size, world, split, drop_last, shuffle)
    (21, 3, 2, False, False, False), (20, 3, 3, False, False, True), (2, 3, 3, False, False, False),
    (21, 4, 2, True, False, False), (23, 6, 3, True, False, True), (21, 3, 2, False, True, True),
    (25, 4, 2, True, True, False), (24, 4, 3, False, False, False),
]


@pytest.mark.parametrize(("n", "size", "world", "split", "drop_last", "shuffle"), CASES)
def test_epoch_of_tensors_is_the_dataset(
    monkeypatch: pytest.MonkeyPatch, n: int, size: int, world: int, split: bool,
    drop_last: bool, shuffle: bool,
) -> None:
    def make() -> DataLoader[int]:
        return DataLoader(range(n), batch_size=size, drop_last=drop_last, shuffle=shuffle)

    def output(batch: torch.Tensor) -> dict[str, Any]:
        return {"x": batch, "pair": (batch * 2, batch.float().reshape(-1, 1))}

    results = simulate_epoch(monkeypatch, world, make, output, split_batches=split)
    if drop_last:
        full = n // size
        expected = full * size if split else (full // world) * world * size
    else:
        expected = n
    for outputs in results.values():
        xs = torch.cat([o["x"] for o in outputs]).tolist()
        assert len(set(xs)) == len(xs) == expected  # each sample once, padding dropped
        if not shuffle:
            assert xs == list(range(expected))
        elif not drop_last:
            assert sorted(xs) == list(range(n))
        assert torch.cat([o["pair"][0] for o in outputs]).tolist() == [2 * x for x in xs]
        assert torch.cat([o["pair"][1] for o in outputs]).flatten().tolist() == xs


@pytest.mark.parametrize("world", [2, 3])
def test_epoch_of_objects_is_the_dataset(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    def make() -> DataLoader[int]:
        return DataLoader(range(11), batch_size=2)

    def output(batch: torch.Tensor) -> list[str]:
        return [f"s{i}" for i in batch.tolist()]

    results = simulate_epoch(monkeypatch, world, make, output)
    for outputs in results.values():
        assert [s for o in outputs for s in o] == [f"s{i}" for i in range(11)]


def test_use_gather_object_for_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def fake_gather_object(obj: Any) -> list[Any]:
        seen.append(obj)
        return [obj, obj]

    monkeypatch.setattr(metrics, "gather_object", fake_gather_object)
    with set_state(ProcessState(rank=0, world_size=2), Scope()):
        out = gather_for_metrics(torch.tensor([1, 2]), use_gather_object=True)
    assert out.tolist() == [1, 2, 1, 2]
    assert len(seen) == 1

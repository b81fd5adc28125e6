"""Loader resume on 1, 2 and 3 real processes when the resumed loader is prepared after another
global RNG state: the rest of the epoch and the next epoch equal the uninterrupted run's.

Each rank runs the reference, stops a second loader at batch ``K`` of epoch ``EPOCH``, saves
it (``state_dict`` of rank 0, as ``save_state`` stores it, and ``save_state`` itself), then
re-seeds the global RNG differently on every rank, prepares new loaders and resumes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import accel
from accel.comm.collectives import broadcast_object
from accel.data import prepare_data_loader
from accel.testing import run_distributed

EPOCH, K = 1, 2
Batches = list[list[int]]


class RandomStream(IterableDataset[int]):
    """Shuffles itself with its ``generator``, seeded from the global RNG when built."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


def _make(kind: str, split: bool, dispatch: bool | None) -> Any:
    size = 6 if split else 2  # divides among 1, 2 and 3 processes
    if kind == "map":
        loader = DataLoader(range(29), batch_size=size, shuffle=True)
    else:
        loader = DataLoader(RandomStream(29), batch_size=size)
    return prepare_data_loader(loader, split_batches=split, dispatch_batches=dispatch)


def _lists(loader: Any) -> Batches:
    return [batch.tolist() for batch in loader]


def _stop_at(loader: Any) -> None:
    for _ in range(EPOCH):
        _lists(loader)
    for index, _batch in enumerate(loader):
        if index + 1 == K:
            break


def _body(kind: str, split: bool, dispatch: bool | None, ckpt: str) -> dict[str, Any]:
    rank = accel.state().rank
    torch.manual_seed(1)  # no set_seed: the first run's seeds come from this global RNG
    reference = _make(kind, split, dispatch)
    epochs = [_lists(reference) for _ in range(EPOCH + 2)]
    torch.manual_seed(1)
    loader = _make(kind, split, dispatch)
    _stop_at(loader)
    saved = loader.state_dict()
    saved_on_rank0 = broadcast_object(saved)  # what save_state stores: rank 0's state
    accel.save_state(ckpt, train_loader=loader)

    torch.manual_seed(1000 + rank)  # "a new process": another global RNG, on every rank
    fresh = _make(kind, split, dispatch)
    fresh_seeds = fresh.state_dict()
    fresh.load_state_dict(saved_on_rank0)
    via_state_dict = (_lists(fresh), _lists(fresh))

    torch.manual_seed(2000 + rank)
    restored = _make(kind, split, dispatch)
    accel.load_state(ckpt, train_loader=restored)
    via_checkpoint = (_lists(restored), _lists(restored))
    return {
        "expected": (epochs[EPOCH][K:], epochs[EPOCH + 1]),
        "via_state_dict": via_state_dict,
        "via_checkpoint": via_checkpoint,
        "saved": saved,
        "fresh_seeds": fresh_seeds,
    }


CASES = [
    ("map", False, False),
    ("map", True, False),
    ("map", False, True),
    ("iterable", False, None),  # dispatched by default on several processes
    ("iterable", True, None),
    ("iterable", False, False),
    ("iterable", True, False),
]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("kind", "split", "dispatch"), CASES)
def test_resume_continues_the_same_order_whatever_the_global_rng(
    tmp_path: Path, world: int, kind: str, split: bool, dispatch: bool | None
) -> None:
    results = run_distributed(
        _body, kind, split, dispatch, str(tmp_path / "ckpt"), world_size=world, timeout=120
    )
    for rank, result in enumerate(results):
        expected = result["expected"]
        assert expected[0], f"rank {rank}: the interrupted epoch must have batches left"
        assert result["via_state_dict"] == expected, f"rank {rank} (load_state_dict)"
        assert result["via_checkpoint"] == expected, f"rank {rank} (load_state)"
    seeds = {(r["saved"]["shuffle_seed"], r["saved"]["worker_seed"]) for r in results}
    assert len(seeds) == 1, f"the seeds differ between ranks: {seeds}"
    shuffle_seed, worker_seed = seeds.pop()
    assert isinstance(shuffle_seed, int) and isinstance(worker_seed, int)
    fresh = results[0]["fresh_seeds"]
    assert (fresh["shuffle_seed"], fresh["worker_seed"]) != (shuffle_seed, worker_seed)


def _save_body(ckpt: str) -> Batches:
    torch.manual_seed(31)
    reference = _make("map", False, False)
    reference_epochs = [_lists(reference), _lists(reference)]
    torch.manual_seed(31)
    loader = _make("map", False, False)
    _lists(loader)
    for index, _batch in enumerate(loader):
        if index == 1:
            break
    accel.save_state(ckpt, train_loader=loader)
    return reference_epochs[1][2:]


def _load_body(ckpt: str) -> Batches:
    torch.manual_seed(77 + accel.state().rank)
    loader = _make("map", False, False)
    accel.load_state(ckpt, train_loader=loader)
    return _lists(loader)


def test_saved_on_two_processes_resumed_by_new_processes(tmp_path: Path) -> None:
    """New processes (another ``run_distributed``) continue what the first ones saved."""
    ckpt = str(tmp_path / "ckpt")
    expected = run_distributed(_save_body, ckpt, world_size=2, timeout=120)
    assert all(expected)
    assert run_distributed(_load_body, ckpt, world_size=2, timeout=120) == expected


def _save_seed_body(ckpt: str) -> int:
    torch.manual_seed(41)
    loader = _make("map", False, False)
    _lists(loader)
    for index, _batch in enumerate(loader):
        if index == 1:
            break
    accel.save_state(ckpt, train_loader=loader)
    seed = loader.state_dict()["shuffle_seed"]
    assert isinstance(seed, int)
    return seed


def test_saved_on_two_processes_resumed_on_one(tmp_path: Path) -> None:
    """2 ranks x 2 batches = global batch 4 of epoch 1, continued in the saved shuffle."""
    ckpt = str(tmp_path / "ckpt")
    seed = run_distributed(_save_seed_body, ckpt, world_size=2, timeout=120)[0]
    with accel.distributed(cpu=True):
        same_shuffle = prepare_data_loader(DataLoader(
            range(29), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(seed)
        ))
        reference = [_lists(same_shuffle), _lists(same_shuffle)]
        torch.manual_seed(5)
        resumed = _make("map", False, False)
        with pytest.warns(UserWarning, match="RNG states are not restored"):
            accel.load_state(ckpt, train_loader=resumed)  # the loader's seeds are
        assert (resumed.epoch, resumed.state_dict()["batches_yielded"]) == (1, 4)
        assert _lists(resumed) == reference[1][4:]

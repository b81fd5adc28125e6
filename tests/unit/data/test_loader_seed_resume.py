"""A loader's state carries its seeds: resuming never depends on the new process's global RNG.

Each test runs an uninterrupted reference, an interrupted run (stopped at batch ``k`` of epoch
``e``) and a resumed run whose loader is prepared after a different global RNG state (or a
different ``accel.distributed(seed=...)``): the resumed batches (the rest of epoch ``e`` and
the whole next epoch) must equal the reference's exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import accel
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.data import prepare_data_loader, skip_first_batches
from accel.data._epoch_seeds import Reseeder
from accel.data._loader_state import read_loader_state
from accel.errors import CheckpointError

Batches = list[list[int]]


class RandomStream(IterableDataset[int]):
    """Shuffles itself with its ``generator``, seeded from the global RNG when built."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


class WorkerRandom(Dataset[int]):
    """Each sample is drawn from the loading worker's torch RNG (random augmentation)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index * 1000 + int(torch.randint(1000, ()))


class WorkerShuffled(IterableDataset[int]):
    """Shuffled with the reading process's torch RNG (a worker's seed with num_workers > 0)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())


def _lists(batches: Any) -> Batches:
    return [batch.tolist() for batch in batches]


def _make(kind: str, split: bool) -> DataLoader[Any]:
    size = 4 if split else 2
    if kind == "map":
        return DataLoader(range(23), batch_size=size, shuffle=True)
    return DataLoader(RandomStream(23), batch_size=size)


def _reference(make: Callable[[], Any], epochs: int) -> list[Batches]:
    loader = make()
    return [_lists(loader) for _ in range(epochs)]


def _interrupt(loader: Any, epoch: int, k: int) -> None:
    """Iterate whole epochs before ``epoch``, then ``k`` batches of it, and stop."""
    for _ in range(epoch):
        _lists(loader)
    for index, _batch in enumerate(loader):
        if index + 1 == k:
            break


def _rest(loader: Any) -> tuple[Batches, Batches]:
    """What a resumed loop sees: the rest of the saved epoch, then the next epoch."""
    return _lists(loader), _lists(loader)


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("epoch", "k"), [(0, 1), (1, 3), (2, 5)])
def test_state_dict_resume_after_other_global_rng(
    kind: str, split: bool, epoch: int, k: int
) -> None:
    def make() -> Any:
        return prepare_data_loader(_make(kind, split), split_batches=split)

    with accel.distributed(cpu=True):
        torch.manual_seed(1)
        reference = _reference(make, epoch + 2)
        torch.manual_seed(1)
        loader = make()
        _interrupt(loader, epoch, k)
        saved = loader.state_dict()
        torch.manual_seed(2)  # the resumed process's global RNG differs
        resumed = make()
        assert resumed.state_dict()["shuffle_seed"] != saved["shuffle_seed"]
        resumed.load_state_dict(saved)
        assert resumed.state_dict() == saved
        assert _rest(resumed) == (reference[epoch][k:], reference[epoch + 1])


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("split", [False, True])
def test_save_state_resume_after_other_state_seed(
    tmp_path: Path, kind: str, split: bool
) -> None:
    """``distributed(seed=...)`` decides a fresh loader's seed; the checkpoint's wins."""

    def make() -> Any:
        return prepare_data_loader(_make(kind, split), split_batches=split)

    with accel.distributed(cpu=True, seed=11):
        reference = _reference(make, 3)
    with accel.distributed(cpu=True, seed=11):
        loader = make()
        _interrupt(loader, 1, 2)
        accel.save_state(tmp_path / "ckpt", train_loader=loader)
    with accel.distributed(cpu=True, seed=12):
        resumed = make()
        accel.load_state(tmp_path / "ckpt", train_loader=resumed)
        assert resumed.epoch == 1
        assert _rest(resumed) == (reference[1][2:], reference[2])
    with accel.distributed(cpu=True):  # no seed at all, another global RNG
        torch.manual_seed(123)
        resumed = make()
        accel.load_state(tmp_path / "ckpt", train_loader=resumed)
        assert _rest(resumed) == (reference[1][2:], reference[2])


def test_worker_seeds_come_back_too() -> None:
    """A stream shuffled with its worker's torch RNG continues the same order."""

    def make() -> Any:
        return prepare_data_loader(DataLoader(WorkerShuffled(15), batch_size=2, num_workers=1))

    with accel.distributed(cpu=True):
        torch.manual_seed(5)
        reference = _reference(make, 3)
        assert reference[1] != reference[2]
        torch.manual_seed(5)
        loader = make()
        _interrupt(loader, 1, 3)
        saved = loader.state_dict()
        assert saved["shuffle_seed"] is None  # the loader shuffles nothing itself
        torch.manual_seed(6)
        resumed = make()
        assert resumed.state_dict()["worker_seed"] != saved["worker_seed"]
        resumed.load_state_dict(saved)
        assert _rest(resumed) == (reference[1][3:], reference[2])


def test_worker_randomness_of_later_epochs_comes_back() -> None:
    """Map-style samples drawn from the workers' RNG: the next epochs draw the same.

    (The skipped samples of the resumed epoch are never loaded, so that epoch's remaining
    draws are not the reference's: only the order is.)
    """

    def make() -> Any:
        return prepare_data_loader(DataLoader(WorkerRandom(), batch_size=3, num_workers=1))

    with accel.distributed(cpu=True):
        torch.manual_seed(5)
        reference = _reference(make, 3)
        torch.manual_seed(5)
        loader = make()
        _interrupt(loader, 1, 1)
        saved = loader.state_dict()
        torch.manual_seed(6)
        resumed = make()
        resumed.load_state_dict(saved)
        rest, following = _rest(resumed)
        assert [[v // 1000 for v in b] for b in rest] == [
            [v // 1000 for v in b] for b in reference[1][1:]
        ]
        assert following == reference[2]


def test_state_without_seeds_keeps_the_loaders_own() -> None:
    """A position without recorded seeds keeps the loader's own seeds."""

    def make() -> Any:
        return prepare_data_loader(DataLoader(range(20), batch_size=2, shuffle=True))

    with set_state(ProcessState(seed=3), Scope()):
        reference = _reference(make, 3)
        resumed = make()
        own = resumed.state_dict()
        resumed.load_state_dict({"epoch": 1, "batches_yielded": 4, "world_size": 1,
                                 "split_batches": 0})
        after = resumed.state_dict()
        assert (after["shuffle_seed"], after["worker_seed"]) == (3, 3)
        assert (own["shuffle_seed"], own["worker_seed"]) == (3, 3)
        assert _rest(resumed) == (reference[1][4:], reference[2])
        explicit_none = make()
        explicit_none.load_state_dict({"epoch": 2, "batches_yielded": 0,
                                       "shuffle_seed": None, "worker_seed": None})
        assert _lists(explicit_none) == reference[2]


def test_huge_seed_round_trips_exactly_through_a_checkpoint(tmp_path: Path) -> None:
    """Seeds up to 2**64 - 1 (a generator's range) survive JSON and every epoch reseeds."""
    top = 2**64 - 1

    def make(seed: int) -> Any:
        generator = torch.Generator().manual_seed(seed)
        return prepare_data_loader(
            DataLoader(range(16), batch_size=2, shuffle=True, generator=generator)
        )

    with accel.distributed(cpu=True):
        reference = _reference(lambda: make(top), 3)
        assert reference[0] != reference[1] != reference[2]
        loader = make(top)
        _interrupt(loader, 1, 3)
        saved = loader.state_dict()
        assert saved["shuffle_seed"] == top and saved["worker_seed"] == top
        assert json.loads(json.dumps(saved)) == saved
        accel.save_state(tmp_path / "ckpt", train_loader=loader)
        texts = [path.read_text() for path in (tmp_path / "ckpt").rglob("*.json")]
        assert any(f'"shuffle_seed": {top}' in text for text in texts)  # an exact JSON int
        resumed = make(5)
        accel.load_state(tmp_path / "ckpt", train_loader=resumed)
        assert resumed.state_dict() == saved
        assert _rest(resumed) == (reference[1][3:], reference[2])


def test_seed_past_the_top_wraps_like_a_generator() -> None:
    generator = torch.Generator()
    Reseeder(generator, 2**64 - 1, ())(2)  # seed + epoch wraps modulo 2**64
    assert generator.initial_seed() == 1
    Reseeder(generator, -5, ())(0)  # as torch.Generator.manual_seed(-5)
    assert generator.initial_seed() == torch.Generator().manual_seed(-5).initial_seed()


def test_views_made_before_loading_use_the_restored_seeds() -> None:
    def make() -> Any:
        return prepare_data_loader(DataLoader(range(20), batch_size=2, shuffle=True))

    with accel.distributed(cpu=True):
        torch.manual_seed(8)
        reference = _reference(make, 2)
        torch.manual_seed(8)
        saved = make().state_dict()
        torch.manual_seed(9)
        resumed = make()
        view = skip_first_batches(resumed, 2, epoch=1)
        resumed.load_state_dict(saved | {"epoch": 1, "batches_yielded": 0})
        assert _lists(view) == reference[1][2:]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"epoch": 0, "batches_yielded": 0, "shuffle_seed": "12"}, "'shuffle_seed'.*'12'"),
        ({"epoch": 0, "batches_yielded": 0, "shuffle_seed": 1.5}, "'shuffle_seed'.*1.5"),
        ({"epoch": 0, "batches_yielded": 0, "worker_seed": True}, "'worker_seed'.*True"),
        ({"epoch": 0, "batches_yielded": 0, "world_size": "2"}, "'world_size'.*'2'"),
        ({"epoch": 0, "batches_yielded": 0, "world_size": 0}, "'world_size'.*0"),
    ],
)
def test_bad_seeds_are_refused_before_anything_changes(bad: dict[str, Any], match: str) -> None:
    with set_state(ProcessState(seed=3), Scope()):
        loader = prepare_data_loader(DataLoader(range(8), batch_size=2, shuffle=True))
        before = loader.state_dict()
        with pytest.raises(CheckpointError, match=match):
            loader.load_state_dict(bad)
        assert loader.state_dict() == before


def test_read_loader_state_rederives_and_keeps_seeds() -> None:
    saved = {"epoch": 2, "batches_yielded": 3, "world_size": 2, "split_batches": 0,
             "shuffle_seed": 2**63 + 1, "worker_seed": 9}
    state = read_loader_state(saved, world_size=3, split_batches=False)
    assert (state.epoch, state.yielded) == (2, 2)
    assert (state.shuffle_seed, state.worker_seed) == (2**63 + 1, 9)

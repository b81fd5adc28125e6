"""The prepared loader on one process, with faked ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from accel.core.scope import Scope, scope
from accel.core.state import ProcessState, set_state
from accel.data import (
    PreparedDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from accel.data._broadcast_batches import concat_rounds
from accel.errors import CheckpointError, ConfigError, DataLoaderTypeError


class Counting(Dataset[int]):
    """A map-style dataset of ``0..n-1`` that counts the samples it loads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded = 0
        self.epochs: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loaded += 1
        return index

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class Stream(IterableDataset[int]):
    def __init__(self, n: int, *, sized: bool = True) -> None:
        self.n = n
        self.sized = sized

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return self.n



def _position(state: dict[str, int]) -> dict[str, int]:
    return {"epoch": state["epoch"], "batches_yielded": state["batches_yielded"]}

def fake(rank: int, world: int, **fields: Any) -> Any:
    return set_state(ProcessState(rank=rank, world_size=world, seed=7, **fields), Scope())


def lists(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_result_is_a_dataloader_with_the_original_options() -> None:
    def init(_: int) -> None:
        return None

    def collate(items: list[int]) -> torch.Tensor:
        return torch.tensor(items) * 10

    generator = torch.Generator().manual_seed(3)
    original = DataLoader(
        range(10), batch_size=2, num_workers=2, collate_fn=collate, pin_memory=False,
        timeout=5.0, worker_init_fn=init, generator=generator, persistent_workers=True,
        prefetch_factor=3,
    )
    with fake(0, 2):
        loader = prepare_data_loader(original)
        assert isinstance(loader, DataLoader)
        assert isinstance(loader, PreparedDataLoader)
        assert prepare_data_loader(loader) is loader
        assert (loader.num_workers, loader.collate_fn, loader.timeout) == (2, collate, 5.0)
        assert loader.worker_init_fn is init
        assert isinstance(loader.generator, torch.Generator)  # its own: worker seeds per epoch
        assert loader.generator is not generator
        assert (loader.persistent_workers, loader.prefetch_factor) == (True, 3)
        assert loader.total_batch_size == 4
        assert lists(loader) == [[0, 10], [40, 50], [80, 90]]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("split", "even", "drop_last"), [
    (False, True, False), (False, False, False), (True, True, False), (True, False, False),
    (False, True, True), (True, True, True),
])
def test_each_rank_gets_its_shard(world: int, split: bool, even: bool, drop_last: bool) -> None:
    n, size = 23, 3 * world if split else 3
    per_rank: list[list[list[int]]] = []
    for rank in range(world):
        with fake(rank, world):
            loader = prepare_data_loader(
                DataLoader(range(n), batch_size=size, drop_last=drop_last),
                split_batches=split, even_batches=even,
            )
            got = lists(loader)
            assert len(loader) == len(got)
            per_rank.append(got)
    seen = {i for rank in per_rank for batch in rank for i in batch}
    if not drop_last:
        assert seen == set(range(n))
    if even:
        assert len({len(r) for r in per_rank}) == 1


def test_worked_example_range21_batch3() -> None:
    expected = {0: [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                1: [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]]}
    for rank in range(2):
        with fake(rank, 2):
            loader = prepare_data_loader(DataLoader(range(21), batch_size=3))
            assert lists(loader) == expected[rank]


def test_last_batch_flags_and_active_loaders() -> None:
    with fake(1, 2):
        loader = prepare_data_loader(DataLoader(range(21), batch_size=3))
        flags = []
        for _ in loader:
            assert scope().active_loaders == [loader]
            flags.append((loader.end_of_dataloader, loader.remainder))
        assert flags == [(False, -1)] * 3 + [(True, 3)]
        assert loader.final_round is not None
        assert loader.final_round.real == (3, 0)
        assert scope().active_loaders == []
        iterator = iter(loader)
        next(iterator)
        assert scope().active_loaders == [loader]
        del iterator  # abandoned mid-epoch: unregistered when collected
        assert scope().active_loaders == []


def test_nested_loaders_innermost_last() -> None:
    with fake(0, 1):
        outer = prepare_data_loader(DataLoader(range(4), batch_size=2))
        inner = prepare_data_loader(DataLoader(range(2), batch_size=1))
        for _ in outer:
            for _ in inner:
                assert scope().active_loaders == [outer, inner]
            assert scope().active_loaders == [outer]


def test_empty_loader() -> None:
    with fake(0, 2):
        loader = prepare_data_loader(DataLoader(range(0), batch_size=2))
        assert lists(loader) == []
        assert len(loader) == 0
        assert scope().active_loaders == []
        assert _position(loader.state_dict()) == {"epoch": 1, "batches_yielded": 0}


def test_shuffle_same_on_every_rank_and_new_each_epoch() -> None:
    n, world = 24, 3
    epochs: dict[int, list[list[list[int]]]] = {}
    for rank in range(world):
        with fake(rank, world):
            loader = prepare_data_loader(DataLoader(range(n), batch_size=2, shuffle=True))
            for epoch in range(3):
                epochs.setdefault(epoch, []).append(lists(loader))
            loader.set_epoch(1)
            assert lists(loader) == epochs[1][rank]
    orders = []
    for epoch in range(3):
        rounds = zip(*epochs[epoch], strict=True)
        order = [i for r in rounds for batch in r for i in batch]
        assert sorted(order) == list(range(n))  # the ranks' shards form one permutation
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]


def test_user_generator_seed_decides_the_shuffle() -> None:
    def epochs(seed: int, state_seed: int) -> list[list[list[int]]]:
        loader = DataLoader(range(12), batch_size=3, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        with set_state(ProcessState(seed=state_seed), Scope()):
            prepared = prepare_data_loader(loader)
            return [lists(prepared), lists(prepared)]

    assert epochs(42, 0) == epochs(42, 1)  # the user's generator wins over state().seed
    assert epochs(42, 0) != epochs(43, 0)
    first, second = epochs(42, 0)
    assert first != second
    assert sorted(i for batch in first for i in batch) == list(range(12))


def test_dataset_set_epoch_is_called() -> None:
    data = Counting(8)
    with fake(0, 2):
        loader = prepare_data_loader(DataLoader(data, batch_size=2))
        lists(loader)
        lists(loader)
        loader.set_epoch(5)
        lists(loader)
    assert data.epochs == [0, 1, 5]


def run_until(loader: Any, count: int) -> list[list[int]]:
    got = []
    for batch in loader:
        got.append(batch.tolist())
        if len(got) == count:
            break
    return got


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_skips_without_loading(shuffle: bool) -> None:
    with fake(1, 2):
        reference = prepare_data_loader(DataLoader(range(40), batch_size=2, shuffle=shuffle))
        whole = [lists(reference), lists(reference)]
        data = Counting(40)
        first = prepare_data_loader(DataLoader(data, batch_size=2, shuffle=shuffle))
        lists(first)
        assert run_until(first, 3) == whole[1][:3]
        position = first.state_dict()
        assert _position(position) == {"epoch": 1, "batches_yielded": 3}
        data.loaded = 0
        resumed = prepare_data_loader(DataLoader(data, batch_size=2, shuffle=shuffle))
        resumed.load_state_dict(position)
        assert resumed.state_dict() == position
        resumed.set_epoch(1)  # the usual per-epoch call keeps the restored position
        assert lists(resumed) == whole[1][3:]
        assert data.loaded == 2 * len(whole[1][3:])  # skipped batches were never loaded
        assert _position(resumed.state_dict()) == {"epoch": 2, "batches_yielded": 0}


def test_resume_across_epoch_boundary() -> None:
    with fake(0, 2):
        loader = prepare_data_loader(DataLoader(range(12), batch_size=2, shuffle=True))
        epoch0 = lists(loader)
        position = loader.state_dict()
        epoch1 = lists(loader)
        assert _position(position) == {"epoch": 1, "batches_yielded": 0}
        resumed = prepare_data_loader(DataLoader(range(12), batch_size=2, shuffle=True))
        resumed.load_state_dict(position)
        assert lists(resumed) == epoch1 != epoch0


def test_break_then_new_iteration_is_next_epoch() -> None:
    with fake(0, 1):
        loader = prepare_data_loader(DataLoader(range(12), batch_size=2, shuffle=True))
        reference = prepare_data_loader(DataLoader(range(12), batch_size=2, shuffle=True))
        epochs = [lists(reference), lists(reference)]
        assert run_until(loader, 2) == epochs[0][:2]
        assert _position(loader.state_dict()) == {"epoch": 0, "batches_yielded": 2}
        assert lists(loader) == epochs[1]


def test_skip_first_batches() -> None:
    data = Counting(20)
    with fake(0, 2):
        loader = prepare_data_loader(DataLoader(data, batch_size=2, shuffle=True))
        reference = prepare_data_loader(DataLoader(range(20), batch_size=2, shuffle=True))
        epochs = [lists(reference), lists(reference)]
        data.loaded = 0
        resumed = skip_first_batches(loader, 2)
        assert isinstance(resumed, DataLoader)
        assert len(resumed) == len(loader) - 2
        assert lists(resumed) == epochs[0][2:]
        assert data.loaded == 2 * (len(epochs[0]) - 2)
        assert len(resumed) == len(loader)
        assert lists(loader) == epochs[1]  # the epoch counter is shared


def test_skip_first_batches_errors() -> None:
    with pytest.raises(DataLoaderTypeError, match="prepared loader"):
        skip_first_batches(DataLoader(range(4)), 1)
    with fake(0, 1):
        loader = prepare_data_loader(DataLoader(range(4)))
        with pytest.raises(ConfigError, match="non-negative"):
            skip_first_batches(loader, -1)


@pytest.mark.parametrize("bad", [{}, {"epoch": 1}, {"epoch": -1, "batches_yielded": 0},
                                 {"epoch": 1, "batches_yielded": 1.5}, [1, 2]])
def test_load_state_dict_rejects_garbage(bad: Any) -> None:
    with fake(0, 1):
        loader = prepare_data_loader(DataLoader(range(4)))
        with pytest.raises(CheckpointError, match="state_dict"):
            loader.load_state_dict(bad)


def test_option_errors() -> None:
    with pytest.raises(DataLoaderTypeError, match="DataLoader"):
        prepare_data_loader(range(4))  # type: ignore[arg-type]
    with fake(0, 2):
        with pytest.raises(ConfigError, match="split_batches"):
            prepare_data_loader(DataLoader(range(9), batch_size=3), split_batches=True)
        with pytest.raises(ConfigError, match="device_placement"):
            prepare_data_loader(DataLoader(range(9)), device_placement=False,
                                dispatch_batches=True)
        with pytest.raises(ConfigError, match="batch_size=None"):
            prepare_data_loader(DataLoader(Stream(4), batch_size=None))
        with pytest.raises(ConfigError, match="batch_size=None"):
            prepare_data_loader(DataLoader(range(4), batch_size=None))


def test_batch_sampler_given_as_sampler() -> None:
    class Fetch(Dataset[list[int]]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, indices: list[int]) -> list[int]:
            return indices

    sampler = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
    with fake(1, 2):
        loader = prepare_data_loader(DataLoader(Fetch(), sampler=sampler, batch_size=None))
        assert list(loader) == [[2, 3], [6, 7], [0, 1]]


def test_variable_size_batch_sampler() -> None:
    batches = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]]
    with fake(1, 2):
        loader = prepare_data_loader(DataLoader(range(14), batch_sampler=batches))
        assert loader.ragged_batches
        assert lists(loader) == [[3, 4], [9, 10, 11], [0, 1, 2]]
        assert loader.final_round is not None
        assert loader.final_round.real == (2, 0)
        assert loader.total_batch_size is None


def test_device_placement_of_nested_batches() -> None:
    def collate(items: list[int]) -> dict[str, Any]:
        return {"x": torch.tensor(items), "pair": (torch.ones(len(items)), "tag")}

    with fake(0, 1, device=torch.device("meta")):
        loader = prepare_data_loader(DataLoader(range(4), batch_size=2, collate_fn=collate))
        batch = next(iter(loader))
        assert batch["x"].device.type == "meta"
        assert batch["pair"][0].device.type == "meta"
        assert batch["pair"][1] == "tag"
        kept = prepare_data_loader(DataLoader(range(4), batch_size=2), device_placement=False)
        assert next(iter(kept)).device.type == "cpu"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("split", [False, True])
def test_iterable_dataset_without_dispatch(world: int, split: bool) -> None:
    size = 2 * world if split else 2
    per_rank = []
    for rank in range(world):
        with fake(rank, world):
            loader = prepare_data_loader(
                DataLoader(Stream(11), batch_size=size), split_batches=split,
                dispatch_batches=False,
            )
            got = lists(loader)
            assert len(loader) == len(got)
            assert loader.final_round is not None
            per_rank.append(got)
    rounds = zip(*per_rank, strict=True)
    order = [i for r in rounds for batch in r for i in batch]
    assert order[:11] == list(range(11))


def test_iterable_dataset_resume_and_unsized() -> None:
    with fake(1, 2):
        loader = prepare_data_loader(DataLoader(Stream(20), batch_size=2),
                                     dispatch_batches=False)
        whole = lists(loader)
        loader.load_state_dict({"epoch": 0, "batches_yielded": 2})
        assert lists(loader) == whole[2:]
        unsized = prepare_data_loader(DataLoader(Stream(7, sized=False), batch_size=2),
                                      dispatch_batches=False)
        got = []
        for batch in unsized:
            got.append(batch.tolist())
        assert got == [[2, 3], [6, 0]]
        assert unsized.remainder == 3  # recorded in-process although the length is unknown


def test_workers_keep_the_final_round_known() -> None:
    with fake(1, 2):
        loader = prepare_data_loader(DataLoader(range(9), batch_size=2, num_workers=2))
        assert lists(loader) == [[2, 3], [6, 7], [1, 2]]
        assert loader.final_round is not None
        assert loader.final_round.real == (1, 0)
        stream = prepare_data_loader(DataLoader(Stream(9), batch_size=2, num_workers=1),
                                     dispatch_batches=False)
        lists(stream)
        assert stream.remainder == 1  # computed from len() since workers hold the shard


def test_dispatch_default_follows_accelerate() -> None:
    with fake(0, 2):
        assert prepare_data_loader(DataLoader(Stream(4), batch_size=2))._plan.mode == "dispatch"
        assert prepare_data_loader(DataLoader(range(4), batch_size=2))._plan.mode == "shard"
        unplaced = prepare_data_loader(DataLoader(Stream(4), batch_size=2),
                                       device_placement=False)
        assert unplaced._plan.mode == "stream"
    with fake(0, 1):
        single = prepare_data_loader(DataLoader(Stream(5), batch_size=2))
        assert single._plan.mode == "stream"
        assert lists(single) == [[0, 1], [2, 3], [4]]
        assert single.remainder == 1


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), size=st.integers(1, 4), world=st.integers(1, 3),
       stop=st.integers(0, 12), shuffle=st.booleans())
def test_state_dict_round_trip_property(
    n: int, size: int, world: int, stop: int, shuffle: bool
) -> None:
    def make() -> Any:
        return prepare_data_loader(DataLoader(range(n), batch_size=size, shuffle=shuffle))

    for rank in range(world):
        with fake(rank, world):
            reference = make()
            epochs = [lists(reference) for _ in range(4)]
            loader, remaining = make(), stop
            for _ in range(2):  # consume `stop` batches, across epochs
                for _ in loader:
                    remaining -= 1
                    if remaining <= 0:
                        break
                if remaining <= 0:
                    break
            position = loader.state_dict()
            fresh = make()
            fresh.load_state_dict(position)
            epoch, start = position["epoch"], position["batches_yielded"]
            assert lists(fresh) == epochs[epoch][start:]
            assert lists(fresh) == epochs[epoch + 1]


def test_concat_rounds_for_dispatch() -> None:
    batches = [torch.arange(i, i + 2) for i in range(0, 10, 2)]
    rounds = [t.tolist() for t in concat_rounds(iter(batches), 2, drop_last=False)]
    assert rounds == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropped = [t.tolist() for t in concat_rounds(iter(batches), 2, drop_last=True)]
    assert dropped == [[0, 1, 2, 3], [4, 5, 6, 7]]
    mixed = [{"x": torch.zeros(2)}, {"y": torch.zeros(2)}]
    with pytest.raises(ConfigError, match="dispatch_batches"):
        list(concat_rounds(iter(mixed), 2, drop_last=False))


def test_uneven_batches_end_per_rank() -> None:
    ends = []
    for rank in range(2):
        with fake(rank, 2):
            loader = prepare_data_loader(DataLoader(range(20), batch_size=3), even_batches=False)
            flags = [loader.end_of_dataloader for _ in loader]
            ends.append((len(loader), flags.index(True) + 1))
    assert ends == [(4, 4), (3, 3)]  # rank 0 has one more batch than rank 1


def test_even_batches_override_and_live_change() -> None:
    with fake(1, 2):
        loader = prepare_data_loader(DataLoader(range(20), batch_size=3))
        assert loader.even_batches
        assert not loader.split_batches
        scope().even_batches_override = False  # as inside join_uneven_inputs(even_batches=False)
        assert lists(loader) == [[3, 4, 5], [9, 10, 11], [15, 16, 17]]
        scope().even_batches_override = None
        assert loader.even_batches
        assert lists(loader)[-1] == [1, 2, 3]
        seen = []
        for batch in loader:  # switched off while the epoch runs: its end is uneven
            loader.even_batches = False
            seen.append(batch.tolist())
        assert seen == [[3, 4, 5], [9, 10, 11], [15, 16, 17]]
        assert len(loader) == 3


class Seeds(Dataset[int]):
    """Returns the loading process's torch seed (a worker's seed with num_workers > 0)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return torch.initial_seed() % 1_000_000


def test_global_rng_untouched_and_worker_seeds_per_epoch() -> None:
    with fake(0, 1):
        torch.manual_seed(0)
        expected = torch.rand(1)
        torch.manual_seed(0)
        lists(prepare_data_loader(DataLoader(range(8), batch_size=2, shuffle=True)))
        assert torch.rand(1) == expected  # iterating drew nothing from the global RNG

        def make() -> Any:
            return prepare_data_loader(DataLoader(Seeds(), batch_size=4, num_workers=1))

        loader = make()
        epochs = [lists(loader), lists(loader)]
        assert epochs[0] != epochs[1]
        again = make()
        again.load_state_dict({"epoch": 1, "batches_yielded": 0})
        assert lists(again) == epochs[1]  # a resumed epoch's workers get the same seeds


class ShuffledStream(IterableDataset[int]):
    """Shuffles itself with its ``generator`` attribute (no set_epoch)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator = torch.Generator()

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


def test_iterable_dataset_generator_reseeded_per_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    import accel.comm.collectives

    monkeypatch.setattr(accel.comm.collectives, "broadcast_object", lambda obj, from_process=0: obj)
    per_rank = []
    for rank in range(2):
        with fake(rank, 2):
            loader = prepare_data_loader(DataLoader(ShuffledStream(12), batch_size=3),
                                         dispatch_batches=False)
            per_rank.append([lists(loader), lists(loader)])
    for epoch in range(2):  # both ranks read the same order, so their shards partition it
        rounds = zip(per_rank[0][epoch], per_rank[1][epoch], strict=True)
        assert sorted(i for r in rounds for batch in r for i in batch) == list(range(12))
    assert per_rank[0][0] != per_rank[0][1]


def test_position_is_rederived_for_another_world_size() -> None:
    with fake(0, 2):
        loader = prepare_data_loader(DataLoader(range(48), batch_size=2))
        run_until(loader, 3)
        position = loader.state_dict()  # 3 batches on each of 2 ranks: global batches 0..5
    assert position["world_size"] == 2
    for rank in range(3):
        with fake(rank, 3):
            moved = prepare_data_loader(DataLoader(range(48), batch_size=2))
            moved.load_state_dict(position)
            assert _position(moved.state_dict()) == {"epoch": 0, "batches_yielded": 2}
            first = lists(moved)[0]
            assert first == [12 + 2 * rank, 13 + 2 * rank]  # global batch 6 + rank
    with fake(0, 4):
        odd = prepare_data_loader(DataLoader(range(48), batch_size=2))
        with pytest.raises(CheckpointError, match="not a multiple of 4"):
            odd.load_state_dict(position)

"""Pure sharding maths: Accelerate's worked examples as tables, and properties over all options."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler

from accel.comm.metrics import FinalRound, trim_gathered
from accel.data._batch_sampler import ShardSpec
from accel.data._rounds import dispatch_slice_size, skip_first, split_counts
from accel.data._stream_shard import shard_stream, stream_final_round
from accel.errors import ConfigError


def shards(
    batches: Any, world: int, *, batch_size: int | None = None, drop_last: bool = False,
    split: bool = False, even: bool = True,
) -> tuple[list[list[list[int]]], list[FinalRound]]:
    """Every rank's batches and the final rounds they recorded."""
    if isinstance(batches, BatchSampler):
        batch_size, drop_last = batches.batch_size, batches.drop_last
    out: list[list[list[int]]] = []
    finals: list[FinalRound] = []
    for rank in range(world):
        spec = ShardSpec(rank=rank, world_size=world, batch_size=batch_size,
                         drop_last=drop_last, split_batches=split, even_batches=even)
        out.append([list(b) for b in spec.shard(batches, finals.append)])
    return out, finals


# Accelerate's tests/test_data_loader.py examples (2 processes): (n, batch, drop_last) -> shards
NO_SPLIT_EVEN = [
    (24, 3, False, [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                    [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]]]),
    (21, 3, False, [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                    [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]]]),
    (21, 3, True, [[[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15, 16, 17]]]),
    (22, 3, False, [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                    [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 0, 1]]]),
    (20, 3, False, [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 0]],
                    [[3, 4, 5], [9, 10, 11], [15, 16, 17], [1, 2, 3]]]),
    (2, 3, False, [[[0, 1, 0]], [[1, 0, 1]]]),
    (2, 3, True, [[], []]),
]
SPLIT_EVEN = [
    (24, 4, False, [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [22, 23]]]),
    (22, 4, False, [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [0, 1]]]),
    (21, 4, False, [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 0]],
                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [1, 2]]]),
    (21, 4, True, [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]],
                   [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]]),
    (2, 4, False, [[[0, 1]], [[0, 1]]]),
]
NO_SPLIT_UNEVEN = [
    (21, 3, False, [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                    [[3, 4, 5], [9, 10, 11], [15, 16, 17]]]),
    (22, 3, False, [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
                    [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21]]]),
    (20, 3, False, [[[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19]],
                    [[3, 4, 5], [9, 10, 11], [15, 16, 17]]]),
    (2, 3, False, [[[0, 1]], []]),
]
SPLIT_UNEVEN = [
    (22, 4, False, [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]]),
    (21, 4, False, [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20]],
                    [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]]),
    (2, 4, False, [[[0, 1]], []]),
]


@pytest.mark.parametrize(
    ("split", "even", "case"),
    [(False, True, c) for c in NO_SPLIT_EVEN] + [(True, True, c) for c in SPLIT_EVEN]
    + [(False, False, c) for c in NO_SPLIT_UNEVEN] + [(True, False, c) for c in SPLIT_UNEVEN],
)
def test_batch_shards_match_accelerate(split: bool, even: bool, case: tuple[Any, ...]) -> None:
    n, size, drop_last, expected = case
    sampler = BatchSampler(range(n), batch_size=size, drop_last=drop_last)
    got, _ = shards(sampler, 2, split=split, even=even)
    assert got == expected
    for rank in range(2):
        spec = ShardSpec(rank=rank, world_size=2, batch_size=size, drop_last=drop_last,
                         split_batches=split, even_batches=even)
        assert spec.num_batches(len(sampler), n % size or size) == len(expected[rank])


def test_rank1_last_batch_cycles_from_start() -> None:
    got, finals = shards(BatchSampler(range(21), 3, False), 2)
    assert got[1][-1] == [0, 1, 2]
    assert finals == [FinalRound(sizes=(3, 3), real=(3, 0))] * 2


@pytest.mark.parametrize(
    ("batches", "world", "even", "expected"),
    [
        ([[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]], 2, False,
         [[[0, 1, 2], [5, 6, 7, 8], [12, 13]], [[3, 4], [9, 10, 11]]]),
        ([[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]], 2, True,
         [[[0, 1, 2], [5, 6, 7, 8], [12, 13]], [[3, 4], [9, 10, 11], [0, 1, 2]]]),
        ([[0, 1, 2]], 3, True, [[[0, 1, 2]]] * 3),
        ([[0], [1, 2], [3, 4, 5], [6], [7, 8], [9, 10, 11], [12, 13]], 3, True,
         [[[0], [6], [12, 13]], [[1, 2], [7, 8], [0]], [[3, 4, 5], [9, 10, 11], [1, 2]]]),
    ],
)
def test_variable_size_batches(
    batches: list[list[int]], world: int, even: bool, expected: list[Any]
) -> None:
    got, finals = shards(batches, world, even=even)
    assert got == expected
    for rank in range(world):
        spec = ShardSpec(rank=rank, world_size=world, batch_size=None, even_batches=even)
        assert spec.num_batches(len(batches)) == len(expected[rank])
    assert finals[0].remainder == len(batches[-1]) + (
        sum(len(b) for b in batches[-(len(batches) % world or world):-1])
    )


def test_variable_size_drop_last_drops_incomplete_round() -> None:
    batches = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11], [12, 13]]
    got, _ = shards(batches, 2, drop_last=True)
    assert got == [[[0, 1, 2], [5, 6, 7, 8]], [[3, 4], [9, 10, 11]]]


@pytest.mark.parametrize(("size", "world"), [(3, 2), (None, 2), (5, 3)])
def test_split_needs_divisible_batch_size(size: int | None, world: int) -> None:
    with pytest.raises(ConfigError, match="split_batches"):
        ShardSpec(rank=0, world_size=world, batch_size=size, split_batches=True)


def test_bad_rank_rejected() -> None:
    with pytest.raises(ConfigError):
        ShardSpec(rank=2, world_size=2, batch_size=1)


def test_short_batch_before_end_is_an_error() -> None:
    spec = ShardSpec(rank=0, world_size=2, batch_size=2)
    with pytest.raises(ConfigError, match="before its end"):
        list(spec.shard([[0, 1], [2], [3, 4], [5, 6]]))
    split = ShardSpec(rank=0, world_size=2, batch_size=2, split_batches=True)
    with pytest.raises(ConfigError, match="before its end"):
        list(split.shard([[0], [1, 2]]))


def test_single_process_is_identity() -> None:
    batches = [[0, 1, 2], [3, 4, 5], [6]]
    finals: list[FinalRound] = []
    spec = ShardSpec(rank=0, world_size=1, batch_size=3, split_batches=True)
    assert list(spec.shard(batches, finals.append)) == batches
    assert finals == [FinalRound(sizes=(1,), real=(1,))]


def test_iterable_shards_match_accelerate() -> None:
    # IterableDatasetShard docstring: 2 processes over [0..7]
    assert [list(shard_stream(range(8), rank=r, world_size=2, per_rank=4, drop_last=False))
            for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(shard_stream(range(8), rank=r, world_size=2, per_rank=2, drop_last=False))
            for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # tiny stream: completed by cycling
    assert [list(shard_stream(range(2), rank=r, world_size=2, per_rank=4, drop_last=False))
            for r in range(2)] == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert list(shard_stream(range(2), rank=0, world_size=2, per_rank=4, drop_last=True)) == []


def test_small_helpers() -> None:
    assert split_counts(5, 2, 4) == (2, 2, 1, 0)
    assert list(skip_first("abcd", 2)) == ["c", "d"]
    assert list(skip_first("abcdef", 2, keep=1)) == ["a", "d", "e", "f"]
    kept = shard_stream(range(12), rank=1, world_size=2, per_rank=2, drop_last=False,
                        skip=2, keep=2)
    assert list(kept) == [2, 3, 10, 11]
    assert dispatch_slice_size(6, 3, last=False) == 2
    assert dispatch_slice_size(7, 3, last=True) == 3
    with pytest.raises(ConfigError, match="dispatch_batches"):
        dispatch_slice_size(7, 3, last=False)
    final = FinalRound(sizes=(3, 3, 3), real=(3, 1, 0))
    assert (final.remainder, final.padded, final.ragged, final.is_prefix) == (4, True, False, True)
    assert not FinalRound(sizes=(2, 2), real=(1, 2)).is_prefix
    assert not FinalRound(sizes=(3, 1), real=(3, 1)).is_prefix


# --------------------------------------------------------------------------- properties


def simulate_gather(rank_batches: list[list[list[int]]], final: FinalRound | None) -> list[int]:
    """What gather_for_metrics returns over an epoch (every rank's view).

    Rounds of different batch sizes are gathered without padding (variable-size batches);
    the last round is padded to one size, gathered and trimmed as the real code does.
    """
    rounds = list(zip(*rank_batches, strict=True))
    out: list[int] = []
    for batches in rounds[:-1]:
        out += [i for batch in batches for i in batch]
    longest = max(len(b) for b in rounds[-1])
    padded = [torch.tensor(b + [-1] * (longest - len(b)), dtype=torch.long) for b in rounds[-1]]
    return out + trim_gathered(padded[0], torch.cat(padded), final).tolist()


def covered(n: int, size: int, world: int, split: bool, drop_last: bool) -> int:
    """How many leading samples a sharded epoch holds."""
    if not drop_last:
        return n
    full = n // size
    return full * size if split else (full // world) * world * size


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 60), size=st.integers(1, 7), world=st.integers(1, 5),
    split=st.booleans(), even=st.booleans(), drop_last=st.booleans(),
)
def test_batch_shards_properties(
    n: int, size: int, world: int, split: bool, even: bool, drop_last: bool
) -> None:
    if split:
        size *= world
    sampler = BatchSampler(range(n), batch_size=size, drop_last=drop_last)
    got, finals = shards(sampler, world, split=split, even=even)
    for rank in range(world):
        spec = ShardSpec(rank=rank, world_size=world, batch_size=size, drop_last=drop_last,
                         split_batches=split, even_batches=even)
        assert spec.num_batches(len(sampler), n % size or size) == len(got[rank])
    flat = sorted(i for rank in got for batch in rank for i in batch)
    expected = covered(n, size, world, split, drop_last)
    assert set(flat) == set(range(expected))  # shards cover exactly what the loader yields
    if even or drop_last or world == 1:
        assert len({len(rank) for rank in got}) == 1  # same number of batches everywhere
    else:
        assert len(flat) == expected  # no padding at all without even_batches
    if len({len(rank) for rank in got}) == 1 and got[0]:
        assert len(set(finals)) == 1  # every rank agrees on the last round
        assert simulate_gather(got, finals[0]) == list(range(expected))


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=0, max_size=12), world=st.integers(1, 4),
    even=st.booleans(),
)
def test_variable_batch_properties(sizes: list[int], world: int, even: bool) -> None:
    batches, start = [], 0
    for size in sizes:
        batches.append(list(range(start, start + size)))
        start += size
    got, finals = shards(batches, world, even=even)
    flat = {i for rank in got for batch in rank for i in batch}
    assert flat == set(range(start))
    if even or world == 1:
        assert len({len(rank) for rank in got}) == 1
    if len({len(rank) for rank in got}) == 1 and got[0]:
        assert simulate_gather(got, finals[0]) == list(range(start))


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 60), size=st.integers(1, 7), world=st.integers(1, 5),
    split=st.booleans(), drop_last=st.booleans(),
)
def test_stream_shards_properties(
    n: int, size: int, world: int, split: bool, drop_last: bool
) -> None:
    if split:
        size *= world
    per_rank = size // world if split else size
    finals: list[FinalRound] = []
    streams = [
        list(shard_stream(range(n), rank=r, world_size=world, per_rank=per_rank,
                          drop_last=drop_last, record=finals.append))
        for r in range(world)
    ]
    assert len({len(s) for s in streams}) == 1
    # the loader batches each rank's stream by per_rank (drop_last as the loader)
    got = [
        [s[i:i + per_rank] for i in range(0, len(s), per_rank)
         if not drop_last or len(s[i:i + per_rank]) == per_rank]
        for s in streams
    ]
    final = stream_final_round(n, world_size=world, per_rank=per_rank, drop_last=drop_last)
    assert finals == ([final] * world if final is not None else [])
    chunk = per_rank * world
    expected = (n // chunk) * chunk if drop_last else n
    if got[0]:
        assert simulate_gather(got, final) == list(range(expected))
    else:
        assert expected == 0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 30), world=st.integers(2, 4), skip=st.integers(0, 6))
def test_stream_skip_drops_leading_elements(n: int, world: int, skip: int) -> None:
    for rank in range(world):
        whole = list(shard_stream(range(n), rank=rank, world_size=world, per_rank=2,
                                  drop_last=False))
        resumed = list(shard_stream(range(n), rank=rank, world_size=world, per_rank=2,
                                    drop_last=False, skip=skip))
        assert resumed == whole[skip:]

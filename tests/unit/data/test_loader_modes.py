"""Prepared loaders hold one mode object chosen at prepare time; the split modules stay small."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import accel
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.data import prepare_data_loader
from accel.data._dispatch_mode import DispatchMode
from accel.data._loader import PreparedDataLoader
from accel.data._shard_mode import ShardMode
from accel.data._stream_mode import StreamMode

ACCEL = Path(accel.__file__).parent


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def fake(rank: int, world: int) -> Any:
    return set_state(ProcessState(rank=rank, world_size=world, seed=7), Scope())


def prepared(loader: DataLoader[Any], **options: Any) -> PreparedDataLoader:
    result = prepare_data_loader(loader, **options)
    assert isinstance(result, PreparedDataLoader)
    return result


def test_each_dataset_kind_gets_its_own_mode_object() -> None:
    with fake(0, 2):
        shard = prepared(DataLoader(range(8), batch_size=2))
        stream = prepared(DataLoader(Stream(8), batch_size=2), dispatch_batches=False)
        dispatch = prepared(DataLoader(Stream(8), batch_size=2))
        dispatch_map = prepared(DataLoader(range(8), batch_size=2), dispatch_batches=True)
    assert type(shard._mode) is ShardMode and shard._plan.mode == "shard"
    assert type(stream._mode) is StreamMode and stream._plan.mode == "stream"
    for loader in (dispatch, dispatch_map):
        assert type(loader._mode) is DispatchMode and loader._plan.mode == "dispatch"
        mode = loader._mode
        assert isinstance(mode, DispatchMode)
        assert mode.device == torch.device("cpu") and (mode.rank, mode.world_size) == (0, 2)
    # the shard mode's sampler is what the DataLoader reads through
    assert isinstance(shard._mode, ShardMode) and shard.batch_sampler is shard._mode.sampler
    assert isinstance(stream._mode, StreamMode) and stream.dataset is stream._mode.stream


@pytest.mark.parametrize(
    ("drop_last", "split", "expected"), [(False, False, 4), (True, False, 3), (False, True, 7)]
)
def test_dispatch_length_counts_rounds(drop_last: bool, split: bool, expected: int) -> None:
    with fake(1, 2):  # 13 samples in batches of 2: 7 batches (the last one short)
        loader = prepared(
            DataLoader(range(13), batch_size=2, drop_last=drop_last), dispatch_batches=True,
            split_batches=split,
        )
    assert len(loader) == expected


def test_even_batches_reaches_only_the_shard_mode() -> None:
    with fake(0, 2):
        shard = prepared(DataLoader(range(8), batch_size=2), even_batches=False)
        stream = prepared(DataLoader(Stream(8), batch_size=2), dispatch_batches=False,
                          even_batches=False)
    assert isinstance(shard._mode, ShardMode) and isinstance(stream._mode, StreamMode)
    assert shard.even_batches is False and shard._mode.sampler.even_batches is False
    shard.even_batches = True
    assert shard._mode.sampler.spec.even_batches is True
    assert stream.even_batches is True  # a stream's last round is always completed
    stream.even_batches = False
    assert stream.even_batches is False and stream._mode.final_round() is not None


def test_ragged_only_for_variable_size_batches_on_several_ranks() -> None:
    with fake(0, 2):
        ragged = prepared(DataLoader(range(6), batch_sampler=[[0, 1, 2], [3], [4, 5]]))
        fixed = prepared(DataLoader(range(6), batch_size=2))
    with fake(0, 1):
        single = prepared(DataLoader(range(6), batch_sampler=[[0, 1, 2], [3], [4, 5]]))
    assert (ragged.ragged_batches, fixed.ragged_batches, single.ragged_batches) == (
        True, False, False,
    )
    assert ragged.total_batch_size is None and fixed.total_batch_size == 4


SPLIT_MODULES = [
    "data/__init__.py", "data/_loader.py", "data/_shard_mode.py", "data/_stream_mode.py",
    "data/_dispatch_mode.py", "data/_batch_sampler.py", "data/_rounds.py",
    "data/_stream_shard.py", "data/_epoch_seeds.py", "data/_loader_state.py",
    "data/_broadcast_batches.py",
    "big_model/dispatch.py", "big_model/_apply_map.py", "big_model/device_map.py",
    "big_model/_explicit_map.py", "big_model/model_walk.py",
]


@pytest.mark.parametrize("relative", SPLIT_MODULES)
def test_split_modules_are_small_and_narrow_without_assert(relative: str) -> None:
    source = (ACCEL / relative).read_text()
    assert len(source.splitlines()) < 500, relative
    asserts = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assert)]
    assert asserts == [], f"{relative}: assert at lines {asserts}"

"""Context parallelism without processes: where cp_size / cp_method come from, how a batch is
split into pieces (labels shifted before the split, global positions), and the refusals."""

from __future__ import annotations

import argparse

import pytest
import torch

import accel
from accel.core.process_group import _cp_method
from accel.errors import ConfigError
from accel.launch.run import add_launch_options, command_line_settings
from accel.parallel.context_parallel.plan import _Plan
from accel.parallel.context_parallel.sharding import _shard


def _plan(method: str, rank: int, size: int = 2) -> _Plan:
    return _Plan(method, size, rank, None)


def test_labels_are_shifted_before_the_split_and_positions_are_global() -> None:
    ids = torch.arange(16).reshape(2, 8)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    first, second = (_shard(batch, _plan("alltoall", r)) for r in (0, 1))
    assert first["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]] * 2
    # the last token of rank 0's piece keeps its target (token 4), held by rank 1's piece
    assert first["shift_labels"].tolist() == [[1, 2, 3, 4], [9, 10, 11, 12]]
    assert second["shift_labels"].tolist() == [[5, 6, 7, -100], [13, 14, 15, -100]]
    assert "attention_mask" not in first  # all ones: dropped
    assert "num_items_in_batch" not in first


def test_ring_pieces_are_head_and_tail() -> None:
    ids = torch.arange(8).unsqueeze(0)
    pieces = [_shard({"input_ids": ids}, _plan("ring", r))["input_ids"].tolist() for r in (0, 1)]
    assert pieces == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    with pytest.raises(ConfigError, match=r"length 6 does not divide by 2 x cp_size = 4"):
        _shard({"input_ids": torch.zeros(1, 6, dtype=torch.long)}, _plan("ring", 0))


def test_one_process_adds_the_shifted_labels_only() -> None:
    ids = torch.arange(4).unsqueeze(0)
    got = accel.parallel.context_parallel.shard_sequence(
        {"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    assert got["input_ids"] is ids and got["shift_labels"].tolist() == [[1, 2, 3, -100]]
    assert got["attention_mask"].tolist() == [[1, 1, 1, 0]]  # kept: no cp, nothing refused
    with pytest.raises(ConfigError, match="needs `input_ids`"):
        accel.parallel.context_parallel.shard_sequence({"labels": ids})


def test_the_method_defaults_by_device_and_ring_needs_cuda() -> None:
    assert _cp_method(None, torch.device("cpu")) == "alltoall"
    assert _cp_method(None, torch.device("cuda", 0)) == "ring"
    assert _cp_method("alltoall", torch.device("cuda", 0)) == "alltoall"
    with pytest.raises(ConfigError, match=r"ring attention .* needs CUDA .*'alltoall'"):
        _cp_method("ring", torch.device("cpu"))
    with pytest.raises(ConfigError, match="not a context parallel method"):
        _cp_method("ulysses", torch.device("cpu"))


def test_options_come_from_the_environment_the_launcher_and_refuse_typos(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match="cp_method"), accel.distributed(cp_methd="ring"):
        pass
    monkeypatch.setenv("ACCEL_CP_METHOD", "zigzag")
    with pytest.raises(ConfigError, match="ACCEL_CP_METHOD"), accel.distributed():
        pass
    monkeypatch.setenv("ACCEL_CP_METHOD", "alltoall")
    monkeypatch.setenv("ACCEL_CP_SIZE", "2")
    with pytest.raises(ConfigError, match=r"cp_size=2 \(world_size=1\) do not divide"), \
            accel.distributed():
        pass
    parser = argparse.ArgumentParser()
    add_launch_options(parser)
    for flags in (["--cp-size", "2", "--cp-method", "ring"],
                  ["--parallelism_config_cp_size", "2", "--cp_method", "ring"]):
        assert command_line_settings(parser.parse_args(flags)) == {
            "cp_size": 2, "cp_method": "ring"}


def test_state_says_where_a_rank_stands() -> None:
    from accel.core.state import ProcessState

    st = ProcessState(rank=5, world_size=8, mesh_shape=(1, 1, 2, 2, 2), cp_method="alltoall")
    assert (st.tp_rank, st.cp_rank, st.dp_rank) == (1, 0, 1)
    assert (st.tp_world_size, st.cp_world_size, st.dp_world_size) == (2, 2, 2)
    with accel.distributed() as one:
        assert (one.cp_rank, one.cp_world_size, one.cp_method) == (0, 1, None)

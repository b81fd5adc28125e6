from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import accel
from accel.errors import CollectiveTypeError
from accel.testing import fake_state


def test_single_process_collectives_are_identity() -> None:
    data = {"a": torch.arange(3), "b": [torch.ones(2, 2), (torch.tensor(1.0),)]}
    assert accel.gather(data) is data
    assert accel.reduce(data) is data
    assert accel.broadcast(data) is data
    assert accel.pad_across_processes(data) is data
    assert accel.gather_object({"x": 1}) == [{"x": 1}]
    assert accel.broadcast_object("obj") == "obj"
    accel.wait_for_everyone()
    with accel.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]


def test_single_process_reduce_applies_scale_on_a_copy() -> None:
    t = torch.tensor([2.0])
    out = accel.reduce(t, "mean", scale=0.5)
    assert out.tolist() == [1.0] and t.tolist() == [2.0]


def test_gather_refuses_non_tensors_and_points_to_gather_object() -> None:
    with pytest.raises(TypeError, match=r"gather_object") as info:
        accel.gather({"loss": torch.zeros(1), "name": "x"})
    assert "['name']" in str(info.value)
    assert isinstance(info.value, accel.AccelError)


def test_reduce_rejects_unknown_reduction() -> None:
    with pytest.raises(accel.errors.CollectiveArgumentError, match="'avg'"):
        accel.reduce(torch.zeros(1), "avg")  # type: ignore[arg-type]


def _shares(inputs: list[int], world: int, padding: bool) -> list[list[int]]:
    shares = []
    for rank in range(world):
        with fake_state(rank=rank, world_size=world), accel.split_between_processes(
            inputs, apply_padding=padding
        ) as mine:
            shares.append(list(mine))
    return shares


def test_split_between_processes_uneven() -> None:
    assert _shares([0, 1, 2, 3, 4], 3, False) == [[0, 1], [2, 3], [4]]
    assert _shares([0, 1, 2, 3, 4], 3, True) == [[0, 1], [2, 3], [4, 4]]
    assert _shares([0], 3, True) == [[0], [0], [0]]
    assert _shares([], 2, True) == [[], []]


def test_split_between_processes_tensors_tuples_and_dicts() -> None:
    with fake_state(rank=1, world_size=2), accel.split_between_processes(
        {"x": torch.arange(5), "names": ("a", "b", "c", "d", "e")}, apply_padding=True
    ) as mine:
        assert mine["x"].tolist() == [3, 4, 4]
        assert mine["names"] == ("d", "e", "e")
    with pytest.raises(CollectiveTypeError, match="split_between_processes"), fake_state(  # noqa: SIM117
        rank=0, world_size=2
    ):
        with accel.split_between_processes(5):  # type: ignore[arg-type]
            pass


@given(
    length=st.integers(0, 60),
    world=st.integers(1, 7),
    padding=st.booleans(),
)
def test_split_between_processes_covers_inputs_in_order(
    length: int, world: int, padding: bool
) -> None:
    inputs = list(range(length))
    shares = _shares(inputs, world, padding)
    if not padding:
        assert [x for share in shares for x in share] == inputs
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    else:
        assert len({len(s) for s in shares}) == 1 or length == 0
        deduplicated = []
        for share in shares:
            for x in share:
                if not deduplicated or x != deduplicated[-1]:
                    deduplicated.append(x)
        assert deduplicated == inputs

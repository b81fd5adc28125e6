"""Assigning to or deleting from ``accel.state()`` raises an explaining ``StateFrozenError``."""

from __future__ import annotations

import copy
import pickle

import attrs
import pytest
import torch

import accel
from accel.core.state import ProcessState
from accel.errors import AccelError, StateFrozenError


def test_setting_an_option_says_to_open_a_nested_block() -> None:
    with accel.distributed(gradient_accumulation_steps=2):
        st = accel.state()
        with pytest.raises(StateFrozenError) as info:
            st.gradient_accumulation_steps = 4  # type: ignore[misc]
        message = str(info.value)
        assert "'gradient_accumulation_steps'" in message and "to 4" in message
        assert "with accel.distributed(gradient_accumulation_steps=4):" in message
        assert accel.state().gradient_accumulation_steps == 2
        with accel.distributed(gradient_accumulation_steps=4):  # the advice works
            assert accel.state().gradient_accumulation_steps == 4


@pytest.mark.parametrize(
    ("name", "value"),
    [("mixed_precision", "bf16"), ("strategy", "ddp"), ("debug", True), ("timeout", 60.0)],
)
def test_every_nested_option_names_itself_and_its_value(name: str, value: object) -> None:
    with pytest.raises(StateFrozenError, match="nested") as info:
        setattr(ProcessState(), name, value)
    assert f"with accel.distributed({name}={value!r}):" in str(info.value)


@pytest.mark.parametrize("name", ["rank", "world_size", "local_rank", "is_main_process"])
def test_launch_facts_cannot_change(name: str) -> None:
    with pytest.raises(StateFrozenError, match=f"{name} is a fact of the launch") as info:
        setattr(ProcessState(), name, 3)
    assert "to 3" in str(info.value)


def test_outermost_only_fields_options_and_unknown_names_are_explained() -> None:
    st = ProcessState()
    with pytest.raises(StateFrozenError, match=r"outermost `accel\.distributed\(seed=\.\.\.\)`"):
        st.seed = 1  # type: ignore[misc]
    with pytest.raises(StateFrozenError, match=r"outermost `accel\.distributed\(backend="):
        st.backend = "gloo"  # type: ignore[misc]
    with pytest.raises(StateFrozenError, match=r"cpu=True"):
        st.device = torch.device("cpu")  # type: ignore[misc]
    with pytest.raises(StateFrozenError, match=r"keywords of a nested block"):
        st.options = {"lr": 1.0}  # type: ignore[misc]
    with pytest.raises(StateFrozenError, match=r"no field 'lr'.*'gradient_accumulation_steps'"):
        st.lr = 1.0  # type: ignore[attr-defined]


def test_deleting_is_refused_too() -> None:
    st = ProcessState(rank=1, world_size=2)
    with pytest.raises(StateFrozenError, match=r"cannot delete 'rank'.*fact of the launch"):
        del st.rank
    with pytest.raises(StateFrozenError, match=r"cannot delete 'mixed_precision'.*nested"):
        del st.mixed_precision
    assert st.rank == 1


def test_error_is_an_attribute_error_and_attrs_frozen_error() -> None:
    st = ProcessState()
    for error in (AttributeError, attrs.exceptions.FrozenInstanceError, AccelError):
        with pytest.raises(error):
            st.rank = 2  # type: ignore[misc]
    assert accel.errors.StateFrozenError is StateFrozenError
    assert not hasattr(st, "lr") and getattr(st, "rank", None) == 0  # getattr untouched
    sent = pickle.loads(pickle.dumps(StateFrozenError("why")))  # crosses ranks as itself
    assert type(sent) is StateFrozenError and sent.args == ("why",) and str(sent) == "why"


def test_construction_evolve_and_copy_still_work() -> None:
    st = ProcessState(rank=1, world_size=2, mixed_precision="bf16", options={"lr": 0.1})
    changed = attrs.evolve(st, gradient_accumulation_steps=4, options={"lr": 0.2})
    assert (changed.rank, changed.world_size, changed.mixed_precision) == (1, 2, "bf16")
    assert changed.gradient_accumulation_steps == 4 and dict(changed.options) == {"lr": 0.2}
    assert st.gradient_accumulation_steps == 1 and dict(st.options) == {"lr": 0.1}
    plain = ProcessState(rank=1, world_size=2)
    duplicate = copy.copy(plain)
    assert duplicate == plain and duplicate is not plain
    with pytest.raises(StateFrozenError):
        duplicate.rank = 0  # type: ignore[misc]

"""set_seed: python, numpy and torch generators; rank offsets; deterministic mode."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch._dynamo  # imported here: it sets TORCHINDUCTOR_CACHE_DIR (conftest env guard)
from hypothesis import given, settings
from hypothesis import strategies as st

import accel
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.errors import ConfigError


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_same_seed_same_numbers(seed: int) -> None:
    accel.set_seed(seed)
    first = _draws()
    accel.set_seed(seed)
    assert _draws() == first


def test_different_seeds_differ() -> None:
    accel.set_seed(1)
    first = _draws()
    accel.set_seed(2)
    second = _draws()
    assert all(a != b for a, b in zip(first, second, strict=True))


def test_device_specific_adds_the_rank() -> None:
    with set_state(ProcessState(rank=2, world_size=4), Scope()):
        accel.set_seed(10, device_specific=True)
        on_rank_two = _draws()
        accel.set_seed(10)
        plain = _draws()
    accel.set_seed(12)
    assert _draws() == on_rank_two
    assert plain != on_rank_two


@pytest.fixture
def _restore_determinism() -> Iterator[None]:
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic = before[2]
    torch.backends.cudnn.benchmark = before[3]


@pytest.mark.usefixtures("_restore_determinism")
def test_deterministic_mode() -> None:
    accel.set_seed(0)
    assert not torch.are_deterministic_algorithms_enabled()
    accel.set_seed(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "42", True])
def test_invalid_seeds(bad: object) -> None:
    with pytest.raises(ConfigError, match="seed="):
        accel.set_seed(bad)  # type: ignore[arg-type]


def test_rank_offset_out_of_range() -> None:
    with set_state(ProcessState(rank=1, world_size=2), Scope()), pytest.raises(ConfigError):
        accel.set_seed(2**32 - 1, device_specific=True)

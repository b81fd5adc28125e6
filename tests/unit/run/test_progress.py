from __future__ import annotations

import importlib.util

import pytest

import accel
from accel import progress_bar
from accel.progress_bar import PlainProgress
from accel.testing import fake_state


def test_bar_on_main_process_only() -> None:
    pytest.importorskip("tqdm", reason="extra accel[progress] not installed")
    data = list(range(5))
    with fake_state(rank=0, world_size=2):
        bar = accel.progress(data, desc="train")
        assert not bar.disable
        assert len(bar) == 5
        assert list(bar) == data
        bar.set_postfix(loss=1.0)
        bar.close()
    for rank in (1, 2):
        with fake_state(rank=rank, world_size=3):
            bar = accel.progress(data, desc="train")
            assert bar.disable
            assert len(bar) == 5
            assert list(bar) == data
            bar.set_postfix(loss=1.0)  # tqdm's methods work (and do nothing) everywhere
            every = accel.progress(data, main_process_only=False)
            assert not every.disable
            every.close()
    with fake_state(rank=0, world_size=2):
        assert accel.progress(data, disable=True).disable  # the user's disable wins


def test_manual_bar_with_total() -> None:
    pytest.importorskip("tqdm", reason="extra accel[progress] not installed")
    with fake_state(rank=1, world_size=2):
        bar = accel.progress(total=10)
        bar.update(3)
        assert len(bar) == 10
        bar.close()


def test_plain_iteration_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        progress_bar.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tqdm" else real(name, *a),
    )
    data = range(4)
    bar = accel.progress(data, desc="x")
    assert isinstance(bar, PlainProgress)
    assert len(bar) == 4
    assert list(bar) == [0, 1, 2, 3]
    with bar as same:
        same.set_postfix(loss=1.0)
        same.set_description("y")
        same.update()
    assert len(accel.progress(total=7)) == 7
    with pytest.raises(TypeError, match="update"):
        iter(accel.progress(total=7))
    with pytest.raises(TypeError):
        len(accel.progress(iter(data)))  # a generator has no length, as with tqdm

"""Warnings where a resume silently goes wrong: a restored loader position overridden.

A loader restored by ``load_state_dict`` (what ``accel.load_state(..., train_loader=...)``
does) already starts at the saved batch of the saved epoch. A script that keeps
Accelerate's ``skip_first_batches(...)`` on it, or whose epoch loop starts at 0 again, drops
that position: each is warned about once, naming the position and the fix.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel.core.scope import Scope
from accel.core.state import ProcessState, set_state
from accel.data import PreparedDataLoader, prepare_data_loader, skip_first_batches


def _make() -> PreparedDataLoader:
    loader = prepare_data_loader(DataLoader(range(12), batch_size=2, shuffle=True))
    assert isinstance(loader, PreparedDataLoader)
    return loader


def _lists(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_skip_first_batches_on_a_restored_loader_is_warned_once(tmp_path: Path) -> None:
    with set_state(ProcessState(seed=3), Scope()):
        first = _make()
        epochs = [_lists(first), _lists(first)]
        first.set_epoch(1)
        for index, _ in enumerate(first):
            if index == 1:
                break  # two batches of epoch 1 yielded
        saved = first.state_dict()
        model = torch.nn.Linear(2, 2)
        accel.save_state(tmp_path / "ckpt", model=model, train_loader=first)
        resumed = _make()
        accel.load_state(tmp_path / "ckpt", model=model, train_loader=resumed)
        assert resumed.state_dict() == saved
        with pytest.warns(
            UserWarning, match=r"restored.*epoch 1, batch 2.*skip_first_batches"
        ) as said:
            view = skip_first_batches(resumed, 2)
        message = str(said[0].message)
        assert "skip_first_batches(loader, 2)" in message and "Drop" in message
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: a second skip says nothing more
            skip_first_batches(resumed, 2)
            assert _lists(view) == epochs[1][2:]
        plain = _make()  # a loader never restored: skip_first_batches is the resume
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(_lists(skip_first_batches(plain, 1))) == 5
        at_start = _make()  # an epoch restored at its start (Accelerate's sampler epoch)
        at_start.load_state_dict(saved | {"batches_yielded": 0})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # there the script's own skip is the resume
            assert _lists(skip_first_batches(at_start, 2)) == epochs[1][2:]
        other = _make()  # restored, then what the docs' recipe does: no warning
        other.load_state_dict(saved)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            other.set_epoch(1)
            assert _lists(other) == epochs[1][2:]


def test_restored_loader_sent_back_to_an_earlier_epoch_is_warned_once() -> None:
    with set_state(ProcessState(seed=3), Scope()):
        reference = _make()
        epochs = [_lists(reference) for _ in range(3)]
        saved = reference.state_dict() | {"epoch": 2, "batches_yielded": 1}
        resumed = _make()
        resumed.load_state_dict(saved)
        resumed.set_epoch(0)  # an epoch loop that starts at 0 again after the resume
        with pytest.warns(UserWarning, match=r"epoch 2.*epoch 0.*set_epoch") as said:
            got = _lists(resumed)
        assert got == epochs[0]  # what it warns about: epoch 0 replayed, position dropped
        assert "loader.epoch" in str(said[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per restore
            resumed.set_epoch(1)
            assert _lists(resumed) == epochs[1]
        kept = _make()
        kept.load_state_dict(saved)
        later = _make()
        later.load_state_dict(saved | {"epoch": 0, "batches_yielded": 3})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kept.set_epoch(2)  # the saved epoch: its position is kept
            assert _lists(kept) == epochs[2][1:]
            assert _lists(later) == epochs[0][3:]  # saved at epoch 0: nothing replayed

"""Notes said once per block: the keys live in the block's Scope, not in module-level flags."""

from __future__ import annotations

import contextvars
import logging
import threading
from pathlib import Path

import pytest
from torch import nn

import accel
from accel.core.once import first_time


@pytest.fixture
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config file (its options would reach the blocks)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)


def test_a_block_says_a_key_once_and_the_next_block_again(no_config: None) -> None:
    key = (__name__, "said")
    with accel.distributed(cpu=True):
        assert first_time(key)
        assert not first_time(key)
        with accel.distributed(mixed_precision="no"):  # nested: the outer block's keys
            assert not first_time(key)
            assert first_time((__name__, "other"))
        assert not first_time((__name__, "other"))
        assert first_time((__name__, "said", "a subject"))  # one key per subject
    with accel.distributed(cpu=True):
        assert first_time(key)
        assert first_time((__name__, "other"))


def test_outside_any_block_a_key_is_said_once_per_process(no_config: None) -> None:
    key = (__name__, "outside")
    assert first_time(key)
    assert not first_time(key)
    with accel.distributed(cpu=True):
        assert first_time(key)  # a block does not see what was said outside it
    assert not first_time(key)  # nor does the block's key leave it
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(first_time(key)))
    thread.start()
    thread.join()
    assert seen == [False]  # a thread outside any block: the same detached record


def test_a_thread_in_the_blocks_context_shares_its_keys(no_config: None) -> None:
    with accel.distributed(cpu=True):
        assert first_time((__name__, "thread"))
        seen: list[bool] = []
        context = contextvars.copy_context()
        thread = threading.Thread(
            target=context.run, args=(lambda: seen.append(first_time((__name__, "thread"))),)
        )
        thread.start()
        thread.join()
        assert seen == [False]


def test_a_second_block_notes_ignored_ddp_options_again(
    caplog: pytest.LogCaptureFixture, no_config: None
) -> None:
    caplog.set_level(logging.DEBUG, logger="accel.parallel.ddp")
    for _ in range(2):
        with accel.distributed(cpu=True):
            accel.prepare_model(nn.Linear(2, 2), static_graph=True)
            accel.prepare_model(nn.Linear(2, 2), static_graph=True)  # said already
    notes = [r for r in caplog.records
             if r.name == "accel.parallel.ddp" and "are ignored" in r.getMessage()]
    assert len(notes) == 2  # once per block
    assert all("Said once per block" in r.getMessage() for r in notes)

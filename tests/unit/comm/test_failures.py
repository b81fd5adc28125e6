"""accel.comm.failures on one process: every rank agrees on a failure, then raises.

The multi-process behaviour (one rank fails, all raise) is covered through its users:
tests/multiproc/test_checkpoint_agreement.py, test_accelerate_checkpoint_multiproc.py,
test_checkpoint_async_multiproc.py.
"""

from __future__ import annotations

import pytest

from accel.comm.failures import agree_on_failure, describe, label_errors, rank_errors
from accel.errors import CheckpointError, ConfigError
from accel.testing import fake_state


def test_describe_keeps_accel_messages_and_names_other_types() -> None:
    assert describe(ConfigError("fix the option")) == "fix the option"
    assert describe(OSError("disk full")) == "OSError: disk full"


def test_errors_are_labelled_with_their_rank_on_several_processes() -> None:
    assert label_errors([None, "boom"]) == ["boom"]  # one process: the error as it is
    with fake_state(rank=0, world_size=3):
        assert label_errors([None, "boom", "bang"]) == ["rank 1: boom", "rank 2: bang"]
        assert label_errors([None, None, None]) == []


def test_rank_errors_on_one_process() -> None:
    assert rank_errors(None) == []
    assert rank_errors("OSError: disk full") == ["OSError: disk full"]


def test_a_block_that_succeeds_returns() -> None:
    done = []
    with agree_on_failure(lambda errors: CheckpointError(errors)):
        done.append(1)
    assert done == [1]


def test_a_failure_is_raised_as_the_callers_error_with_every_message() -> None:
    fail = agree_on_failure(lambda errors: CheckpointError(f"restoring failed: {errors}"))
    with pytest.raises(CheckpointError, match=r"^restoring failed: KeyError: 'w'$") as info, fail:
        raise KeyError("w")
    assert info.value.__suppress_context__  # shown alone, as one rank's error among all


def test_an_interrupt_leaves_without_the_collective() -> None:
    with pytest.raises(KeyboardInterrupt), agree_on_failure(lambda e: CheckpointError(e)):
        raise KeyboardInterrupt

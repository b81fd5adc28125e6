"""The core of elastic resume: a run saved at world size 2 mid-epoch and resumed at world 1
with ``keep_global_batch=2`` ends equal (to the reduction order, ~1e-7) to an uninterrupted
world-2 run at the same global batch (measured: bit-equal with accumulation 1, 2e-8 with
2); the LR schedule and the step count are the same.
A world that cannot keep the global batch is refused, naming both sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accel.errors import ConfigError
from accel.testing import run_distributed
from tests.multiproc.elastic_script import train_quietly

pytestmark = pytest.mark.preload("tests.multiproc.elastic_script")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("steps", [1, pytest.param(2, marks=pytest.mark.ci_extra)],
                         ids=["accumulation1", "accumulation2"])
def test_saved_at_two_resumed_at_one_equals_uninterrupted(tmp_path: Path, steps: int) -> None:
    options = {"keep_global_batch": 2, "gradient_accumulation_steps": steps}
    straight = run_distributed(train_quietly, str(tmp_path / "straight"), world_size=2,
                               **options)
    # dies after optimizer step 5: the newest checkpoint is step 4 (mid-epoch 1 for steps=1)
    died = run_distributed(train_quietly, str(tmp_path / "elastic"), 4, 5, world_size=2,
                           **options)
    assert [r["stopped"] for r in died] == [5, 5]
    resumed = run_distributed(train_quietly, str(tmp_path / "elastic"), world_size=1,
                              **options)[0]  # no save: the checkpoint stays for `plain`
    assert resumed["world_size"] == 1 and resumed["resumed_from"] == 4
    assert resumed["accumulation"] == 2 * steps  # the global batch of 2 processes kept
    assert straight[0]["accumulation"] == steps
    assert resumed["steps"] == straight[0]["steps"] == 36 // (2 * steps)
    assert resumed["lr"] == straight[0]["lr"]  # the schedule: 2 steps per optimizer step
    assert _close(resumed["weights"], straight[0]["weights"]) < 1e-6
    # without the option the same resume runs at a different global batch: visibly different
    plain = run_distributed(train_quietly, str(tmp_path / "elastic"), world_size=1,
                            gradient_accumulation_steps=steps)[0]
    assert _close(plain["weights"], straight[0]["weights"]) > 1e-3


def test_a_world_that_cannot_keep_the_global_batch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"keep_global_batch=2.*at world size 3"):
        run_distributed(train_quietly, str(tmp_path), world_size=3, keep_global_batch=2)

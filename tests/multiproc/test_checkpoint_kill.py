"""A save killed with SIGKILL at a random moment never breaks the latest checkpoint."""

from __future__ import annotations

import pathlib
import random
import signal
import time

import pytest
import torch
from torch import nn

import accel
from accel.testing import start_script

SCRIPT = pathlib.Path(__file__).with_name("kill_save_script.py")


@pytest.mark.slow
def test_sigkill_during_save_state_leaves_a_loadable_latest(tmp_path: pathlib.Path) -> None:
    rng = random.Random(1234)
    last_step = 0
    for _ in range(6):
        # `python kill_save_script.py ROOT`, forked from warm workers (the SIGKILL is what is
        # tested, not the interpreter's start)
        with start_script(SCRIPT, str(tmp_path), world_size=1, launch=False,
                          env={"OMP_NUM_THREADS": "1"}, timeout=120) as run:
            run.wait_for("START")  # the run has resumed
            time.sleep(rng.uniform(0.05, 0.6))
            run.send_signal(signal.SIGKILL)
            assert run.wait(check=False).exit_codes == (-signal.SIGKILL,)
        latest = accel.latest_checkpoint(tmp_path)
        if latest is None:
            continue
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
        info = accel.load_state(tmp_path, model=model)
        assert info is not None and info.step is not None
        assert info.step >= last_step, "the latest checkpoint went backwards"
        last_step = info.step
        assert all(torch.all(p == float(info.step)) for p in model.parameters())
        complete = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoint_")]
        assert 1 <= len(complete) <= 4  # total_limit=3, plus at most one being rotated
    assert last_step > 0

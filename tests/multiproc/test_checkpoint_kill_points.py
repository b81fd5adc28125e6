"""Killed before any one of its file-system operations, or by SIGKILL at a random moment,
save_state never leaves the root without a loadable checkpoint, never mixes two, and never
loses the user's files."""

from __future__ import annotations

import json
import pathlib
import random
import signal
import time

import pytest
import torch
from torch import nn

import accel
from accel.testing import run_script, start_script

HERE = pathlib.Path(__file__).parent


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["step", "fixed"])
@pytest.mark.ci_extra
def test_kill_before_every_file_operation_of_save_state(
    tmp_path: pathlib.Path, mode: str
) -> None:
    # `python kill_points_script.py ROOT MODE`, forked from warm workers (it forks the
    # children it kills itself); raises if it fails
    done = run_script(HERE / "kill_points_script.py", str(tmp_path), mode, world_size=1,
                      launch=False, env={"OMP_NUM_THREADS": "1"}, timeout=240)
    report = json.loads(done.output.strip().splitlines()[-1])
    assert report["problems"] == []
    assert report["points"] >= 10, report  # every operation of a save was a kill point
    assert report["random_kills"] == 20, report
    assert (tmp_path / "train_log.txt").read_text() == "the user's file\n"


FIXED_SCRIPT = """
import sys, torch
from torch import nn
import accel
root = sys.argv[1]
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
with accel.distributed():
    info = accel.load_state(root, missing_ok=True, model=model)
    value = float(model[0].weight[0, 0]) + 1 if info else 1.0
    print("START", flush=True)
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        accel.save_state(root, model=model)
        value += 1
"""


@pytest.mark.slow
def test_sigkill_at_random_moments_while_replacing_a_fixed_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    script = tmp_path / "save_loop.py"
    script.write_text(FIXED_SCRIPT)
    root = tmp_path / "ckpt"
    rng = random.Random(4321)
    last = 0.0
    for attempt in range(8):
        # `python save_loop.py ROOT`, forked from warm workers (the SIGKILL is what is tested)
        with start_script(script, str(root), world_size=1, launch=False,
                          env={"OMP_NUM_THREADS": "1"}, timeout=120) as run:
            run.wait_for("START")
            time.sleep(rng.uniform(0.05, 0.5))
            run.send_signal(signal.SIGKILL)
            assert run.wait(check=False).exit_codes == (-signal.SIGKILL,)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
        info = accel.load_state(root, missing_ok=attempt == 0, model=model)
        if info is None:
            continue
        values = {float(v) for p in model.parameters() for v in torch.unique(p.detach())}
        assert len(values) == 1, f"mixed weights after a kill: {sorted(values)[:5]}"
        value = values.pop()
        assert value >= last, "the checkpoint went backwards"
        last = value
    assert last > 0

"""Elastic resume on two namespaced machines (one process each): `accel launch --nnodes 1:2
--max-restarts 2 --keep-global-batch max` with torch's c10d rendezvous on machine 0.

- Machine 1 is SIGKILLed mid-run: machine 0's workers end (accel names the lost machine), its
  agent re-rendezvous alone and restarts them at world size 1 from the last checkpoint with the
  accumulation doubled; the final weights equal an uninterrupted world-2 run's.
- Machine 1 then comes back: machine 0's agent sees it waiting and restarts the group at world
  size 2 (accumulation 1 again) from the last checkpoint; still equal at the end.

The rendezvous options shorten torch's waits (see docs/launching.md, "Elastic jobs"):
``last_call_timeout`` (30 s by default) and the keep-alive that declares the lost agent dead
(5 s x 3 by default).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from accel.testing import run_distributed
from accel.testing.machines import MachineRun, Machines, requires_machines
from tests.cli._helpers import clean_env
from tests.multiproc.elastic_script import train_quietly

pytestmark = [pytest.mark.ci_extra, requires_machines(),
              pytest.mark.preload("tests.multiproc.elastic_script")]

SCRIPT = Path(__file__).parents[1] / "multiproc" / "elastic_script.py"
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3"


def _launch(bed: Machines, k: int, tmp: Path, pause: float) -> MachineRun:
    command = [
        sys.executable, "-m", "accel.cli", "launch", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-endpoint", f"{bed.hostname(0)}:29400", "--rdzv-id", "elastic",
        "--rdzv-conf", RDZV_CONF, "--max-restarts", "2", "--monitor-interval", "0.5",
        "--keep-global-batch", "max",
        str(SCRIPT), str(tmp / "checkpoints"), str(tmp / "final.safetensors"),
        "--every", "2", "--pause", str(pause),
    ]
    return bed.start(k, command, env=clean_env(tmp), cwd=str(tmp))


def _wait_for(run: MachineRun, text: str, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in run.output:
        if run.returncode is not None or time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never came from {run.describe()}:\n{run.output}")
        time.sleep(0.1)


def _uninterrupted(tmp: Path) -> dict[str, torch.Tensor]:
    return run_distributed(train_quietly, str(tmp / "straight"), world_size=2,
                           keep_global_batch=2)[0]["weights"]


def _assert_equal_to_uninterrupted(tmp: Path) -> None:
    final = safetensors.torch.load_file(str(tmp / "final.safetensors"))
    straight = _uninterrupted(tmp)
    assert final.keys() == straight.keys()
    worst = max(float((final[k] - straight[k]).abs().max()) for k in final)
    assert worst < 1e-6, worst


def test_a_lost_machine_resumes_at_world_one_at_the_same_global_batch(tmp_path: Path) -> None:
    with Machines(2, shared=tmp_path) as bed:
        runs = [_launch(bed, k, tmp_path, pause=0.3) for k in range(2)]
        _wait_for(runs[0], "ELASTIC saved step=6", timeout=120)
        bed.kill(1)
        assert runs[0].wait(timeout=180) == 0, runs[0].output
        out = runs[0].output
    assert "Lost machine 'm1'" in out  # the survivors' workers ended, naming the machine
    restarted = out.index("ELASTIC world=1 accumulation=2 resumed_from=")
    assert out.index("ELASTIC world=2 accumulation=1 resumed_from=0") < restarted
    resumed_from = int(out[restarted:].split("resumed_from=")[1].split()[0])
    assert resumed_from >= 6 and resumed_from % 2 == 0
    assert "ELASTIC done steps=18" in out
    _assert_equal_to_uninterrupted(tmp_path)


def test_a_machine_that_comes_back_joins_at_the_next_restart(tmp_path: Path) -> None:
    with Machines(2, shared=tmp_path) as bed:
        runs = [_launch(bed, k, tmp_path, pause=1.0) for k in range(2)]
        _wait_for(runs[0], "ELASTIC saved step=4", timeout=120)
        bed.kill(1)
        _wait_for(runs[0], "ELASTIC world=1 accumulation=2", timeout=120)
        back = _launch(bed, 1, tmp_path, pause=1.0)  # its agent waits; machine 0's restarts
        assert runs[0].wait(timeout=180) == 0, runs[0].output
        assert back.wait(timeout=60) == 0, back.output
        out, out_back = runs[0].output, back.output
    alone = out.index("ELASTIC world=1 accumulation=2")
    rejoined = out.index("ELASTIC world=2 accumulation=1 resumed_from=", alone)
    assert alone < rejoined
    assert "ELASTIC world=1" not in out_back  # it joined machine 0's group, not one of its own
    assert "ELASTIC done steps=18" in out or "ELASTIC done steps=18" in out_back
    _assert_equal_to_uninterrupted(tmp_path)

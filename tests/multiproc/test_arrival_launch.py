"""A launched script with diffusers' gated ``save_state`` ends with the arrival error, every rank.

The bound comes from ``ACCEL_ARRIVAL_TIMEOUT`` as ``accel launch`` passes settings; the store is
a TCPStore as under torchrun. Rank 0 raises within the bound and leaves at once; rank 1,
blocked in the next backward's all-reduce, ends too (the launcher's fail-fast). Each run is
bounded far below the 30-minute collective timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from accel.testing import run_script
from tests.cli._helpers import accel_command, clean_env, clean_env_changes, run_bounded

# diffusers' train_unconditional.py shape: a checkpoint every few steps, gated on rank 0
SCRIPT = '''
import torch
import accel

with accel.distributed() as st:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accel.prepare(model, opt)
    for step in range(4):
        accel.backward(model(torch.ones(8, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        if st.is_main_process and step == 1:  # ported as is from Accelerate
            accel.save_state(f"ckpt/checkpoint-{step}", model=model, optimizer=opt)
    print(f"FINISHED rank {st.rank}", flush=True)
'''


def test_a_launched_gated_save_state_ends_the_job_with_the_arrival_error(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = clean_env_changes(tmp_path, ACCEL_ARRIVAL_TIMEOUT="2", OMP_NUM_THREADS="1")
    done = run_script("train.py", world_size=2, cwd=tmp_path, env=env, timeout=60, check=False)
    logs = "\n".join(out + err for out, err in zip(done.stdout, done.stderr, strict=True))
    assert not done.timed_out, logs  # no hang: the run ended by itself
    assert done.failed_rank == 0 and done.exit_codes[0] == 1, logs
    assert done.exit_codes[1] != 0, logs  # the peer blocked in the all-reduce ended too
    assert done.traceback is not None and "ArrivalTimeoutError" in done.traceback, logs
    assert "accel.save_state() must be called on every rank" in done.traceback
    assert "ranks [1] never arrived within arrival_timeout=2.0s" in done.traceback
    assert "FINISHED" not in logs
    assert not (tmp_path / "ckpt" / "checkpoint-1").exists()


@pytest.mark.ci_extra
def test_accel_launch_ends_the_job_named_after_the_gated_save_state(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    done = run_bounded(accel_command("launch", "--nproc-per-node", "2", "train.py"), cwd=tmp_path,
                       env=clean_env(tmp_path, ACCEL_ARRIVAL_TIMEOUT="2", OMP_NUM_THREADS="1"),
                       timeout=90)
    out = done.stdout
    assert done.returncode == 1, out
    assert "ArrivalTimeoutError" in out and "accel.save_state()" in out, out
    assert "ranks [1] never arrived" in out, out
    first = [line for line in out.splitlines() if line.endswith("(first failure)")]
    assert len(first) == 1 and "rank 0" in first[0], out
    assert "FINISHED" not in out

"""`accel launch --use_deepspeed --zero_stage 2` on 2 CPU processes: the launcher's reliability
holds under DeepSpeed's engine as under DDP.

- a rank that raises ends the job within seconds (rank 0 waits in ZeRO-2's gradient reduction
  that rank 1 never joins) and is named, with its traceback, as the first failure;
- SIGTERM to the launcher: every rank sees `accel.stop_requested()` at the same step, saves
  (`save_state` under ZeRO-2: the engine's state by parameter name) and exits 0; the relaunch
  resumes to exactly the weights of a run that was never stopped.

The stop goes through a real `accel launch` with those flags (it forwards the signal); the
failing run, the uninterrupted reference run (beside the launched one) and the relaunch fork
from warm workers (`run_script`/`start_script`: the variables those flags give the workers),
to keep the file at ~10 s.
"""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel.errors import LaunchError
from accel.testing import run_script, start_script
from tests.cli._helpers import Launched, clean_env_changes

pytestmark = [
    pytest.mark.slow,  # real `accel launch` runs (an interpreter importing torch and DeepSpeed)
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="needs the deepspeed extra"),
    pytest.mark.preload("deepspeed", "deepspeed.runtime.engine",
                        "deepspeed.runtime.zero.stage_1_and_2"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# examples/preemptible.py's loop under DeepSpeed (the strategy comes from the launch flags);
# rank 1 raises before step --raise-at when asked
SCRIPT = '''
import argparse, time
from pathlib import Path
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import accel

parser = argparse.ArgumentParser()
parser.add_argument("--output-dir", default="run")
parser.add_argument("--total-steps", type=int, default=30)
parser.add_argument("--step-delay", type=float, default=0.0)
parser.add_argument("--raise-at", type=int, default=-1)
args = parser.parse_args()
root = Path(args.output_dir)


def check_batch(step):
    raise ValueError(f"bad batch at step {step} on rank 1")


with accel.distributed(seed=0) as st:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 6, generator=g), torch.randn(96, 1, generator=g))
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = accel.prepare(model, optimizer, loader)
    objects = {"model": model, "optimizer": optimizer, "train_loader": loader}
    info = accel.load_state(root / "checkpoints", missing_ok=True, **objects)
    step = info.step if info else 0
    accel.print(f"starting at step {step} under ZeRO-{model.zero_optimization_stage()}",
                flush=True)
    stopped = False
    while step < args.total_steps and not stopped:
        for x, y in loader:
            if st.rank == 1 and step == args.raise_at:
                check_batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            accel.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            accel.print(f"step {step}", flush=True)
            time.sleep(args.step_delay)
            if step >= args.total_steps:
                break
            if accel.stop_requested():
                accel.save_state(root / "checkpoints", step=step, total_limit=2, **objects)
                accel.print(f"stop requested: saved step {step}, exiting", flush=True)
                stopped = True
                break
    if not stopped:
        accel.save_model(model, root / "final")
        accel.print(f"finished at step {step}", flush=True)
'''

FLAGS = ["--nproc-per-node", "2", "--cpu", "--use_deepspeed", "--zero_stage", "2"]
# what those flags give the workers, for the warm-worker runs
ENV = {"ACCEL_STRATEGY": "deepspeed", "ACCEL_ZERO_STAGE": "2"}
FAIL_BOUND_S = 30  # it ends in ~2 s; a hung job would wait for the 30-minute timeout


def test_a_raising_rank_ends_the_deepspeed_job_and_is_named(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    began = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_script("train.py", "--raise-at", "3", world_size=2, cwd=tmp_path,
                   env=clean_env_changes(tmp_path, **ENV), timeout=FAIL_BOUND_S)
    assert time.monotonic() - began < FAIL_BOUND_S / 2
    message = str(info.value)
    assert "train.py failed on rank 1 of 2: raised ValueError: bad batch at step 3 on rank 1" \
        in message, message
    assert "in check_batch" in message


@pytest.mark.ci_extra
def test_sigterm_saves_every_rank_at_one_step_and_the_relaunch_resumes_exactly(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    # a long GIL switch interval widens the window in which gloo's worker thread, releasing the
    # block's last collectives, waits for the GIL while rank 0 ends its interpreter: before the
    # final barrier's work was kept (accel.core.exit_refs), rank 0 aborted then in about one
    # launch in two ("terminate called without an active exception"); in one in ten without it
    script.write_text("import sys\nsys.setswitchinterval(0.5)\n" + SCRIPT)
    env = clean_env_changes(tmp_path, **ENV)

    # the uninterrupted run goes on beside the launched one
    straight = start_script(script, "--output-dir", str(tmp_path / "straight"), world_size=2,
                            cwd=tmp_path, env=env)
    stopped = ["--output-dir", str(tmp_path / "stopped"), "--step-delay", "0.05"]
    first = Launched([*FLAGS, str(script), *stopped], tmp_path)
    first.wait_for("step 4\n")  # only rank 0 prints
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 0, first.output[-3000:]
    assert "stopped by SIGTERM: all 2 workers exited 0" in first.output
    saved = [line for line in first.lines if line.startswith("stop requested: saved step")]
    assert len(saved) == 1, first.output[-3000:]
    stopped_at = int(saved[0].split()[4].rstrip(","))
    assert 4 <= stopped_at < 30
    assert "finished at step" not in first.output

    reference = straight.wait().output  # raises if a rank failed
    assert "starting at step 0 under ZeRO-2" in reference
    assert "finished at step 30" in reference
    second = run_script(script, *stopped, world_size=2, cwd=tmp_path, env=env).output
    assert f"starting at step {stopped_at} under ZeRO-2\n" in second
    assert "finished at step 30" in second

    expected = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "stopped" / "final" / "model.safetensors"))
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name

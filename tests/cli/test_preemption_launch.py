"""`accel launch` and a requested stop: the signal reaches every worker, workers that stop and
exit 0 make the launcher exit 0, the others are killed after `--stop-grace-period`; the
preemptible example resumes to the exact weights of an uninterrupted run."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel.cli.main import build_parser
from accel.core.env import LaunchEnv
from accel.errors import ConfigError
from accel.launch.graceful import stop_outcome, supported_stop_args
from accel.launch.run import plan_launch
from accel.testing import run_script
from tests.cli._helpers import (
    Launched,
    call_accel,
    clean_env_changes,
    results,
    write_script,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "preemptible.py"


def _final_weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "final" / "model.safetensors"))


@pytest.mark.ci_extra
@pytest.mark.slow
def test_sigterm_to_the_launcher_then_relaunch_gives_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    # the stop is sent to a real `accel launch`; the uninterrupted reference run and the
    # relaunch are the same 2-process launch forked from warm workers (run_script)
    def relaunch(*args: str) -> str:
        return run_script(EXAMPLE, "--total-steps", "40", *args, world_size=2, cwd=tmp_path,
                          env=clean_env_changes(tmp_path)).output

    straight = relaunch("--output-dir", str(tmp_path / "straight"))
    assert "finished at step 40" in straight

    common = ["--nproc-per-node", "2", "--cpu", str(EXAMPLE), "--total-steps", "40"]
    stopped = ["--output-dir", str(tmp_path / "stopped"), "--step-delay", "0.05"]
    first = Launched([*common, *stopped], tmp_path)
    first.wait_for("step 5\n")  # only rank 0 prints
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 0, first.output[-3000:]
    assert "all 2 workers exited 0" in first.output
    saved = [line for line in first.lines if line.startswith("stop requested: saved step")]
    assert len(saved) == 1, first.output[-3000:]
    stopped_at = int(saved[0].split()[4].rstrip(","))
    assert 5 <= stopped_at < 40
    assert "finished at step" not in first.output

    second = relaunch(*stopped)  # raises if a rank fails
    assert f"starting at step {stopped_at}\n" in second
    assert "finished at step 40" in second

    expected, got = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "stopped")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


STOPPING_SCRIPT = '''
import json, os, time
import torch
import accel

with accel.distributed() as st:
    model = accel.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stopped_at = -1
    for step in range(3000):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
        if step == 3:
            print("READY", flush=True)
        if accel.stop_requested():
            stopped_at = step
            break
    print("RESULT " + json.dumps({"rank": st.rank, "stopped_at": stopped_at}), flush=True)
'''


@pytest.mark.ci_extra
@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "sig"), [(2, signal.SIGINT), (3, signal.SIGUSR1)])
def test_a_signal_to_the_launcher_stops_every_rank_at_the_same_step(
    tmp_path: Path, nproc: int, sig: signal.Signals
) -> None:
    script = write_script(tmp_path, STOPPING_SCRIPT)
    launched = Launched(["--nproc-per-node", str(nproc), "--cpu", str(script)], tmp_path)
    launched.wait_for("READY", count=nproc)
    launched.proc.send_signal(sig)
    assert launched.finish() == 0, launched.output[-3000:]
    found = results(launched.output)
    assert [r["rank"] for r in found] == list(range(nproc))
    steps = {r["stopped_at"] for r in found}
    assert len(steps) == 1 and steps.pop() >= 3, found
    assert f"stopped by {sig.name}: all {nproc} workers exited 0" in launched.output


IGNORING_SCRIPT = '''
import os, signal, sys, time
import accel

with accel.distributed() as st:
    if st.rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # never stops: killed after the grace
    print("READY", flush=True)
    time.sleep(300)
'''


@pytest.mark.slow
@pytest.mark.ci_extra  # a whole launch: ~5-8 s
def test_workers_that_do_not_stop_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = write_script(tmp_path, IGNORING_SCRIPT)
    launched = Launched(["--nproc-per-node", "2", "--cpu", "--stop-grace-period", "1",
                         str(script)], tmp_path)
    launched.wait_for("READY", count=2)
    launched.proc.send_signal(signal.SIGTERM)
    assert launched.finish(timeout=120) == 128 + signal.SIGTERM, launched.output[-3000:]
    out = launched.output
    assert "stopped by SIGTERM; workers terminated." in out
    assert "local rank 0: killed by signal SIGKILL (still running after the 1 s grace" in out
    assert "local rank 1: killed by signal SIGTERM" in out  # no handler: the default action


NOTING_SCRIPT = '''
import signal, time
import accel

with accel.distributed():
    signal.signal(signal.SIGTERM, lambda *_: print("GOT TERM", flush=True))
    print("READY", flush=True)
    time.sleep(300)
'''


@pytest.mark.slow
@pytest.mark.ci_extra  # a whole launch: ~5-8 s
def test_a_second_signal_to_the_launcher_kills_the_workers_at_once(tmp_path: Path) -> None:
    script = write_script(tmp_path, NOTING_SCRIPT)
    launched = Launched(["--nproc-per-node", "2", "--cpu", "--stop-grace-period", "600",
                         str(script)], tmp_path)
    launched.wait_for("READY", count=2)
    launched.proc.send_signal(signal.SIGTERM)
    launched.wait_for("GOT TERM", count=2)  # forwarded; the workers keep running
    launched.proc.send_signal(signal.SIGTERM)
    # well before the 600 s grace period would end
    assert launched.finish(timeout=120) == 128 + signal.SIGTERM, launched.output[-3000:]
    assert launched.output.count("killed by signal SIGKILL") == 2, launched.output[-3000:]


# --- planning and reporting (no workers) ------------------------------------------------------


def _plan_args(*argv: str) -> list[str]:
    ns = build_parser().parse_args(["launch", *argv, "train.py"])
    plan = plan_launch(ns, env=LaunchEnv(), file_settings={}, config_file=None,
                       gpu_count=lambda: 0, cpu_count=4, omp_num_threads_set=False)
    return list(plan.torchrun_args)


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_plan_forwards_the_stop_signals_with_the_grace_period() -> None:
    args = _plan_args()
    assert _value(args, "--signals-to-handle").split(",")[:3] == ["SIGTERM", "SIGINT", "SIGUSR1"]
    assert _value(args, "--shutdown-timeout") == "60"
    assert _value(_plan_args("--stop-grace-period", "2.5"), "--shutdown-timeout") == "3"
    assert _value(_plan_args("--stop_grace_period", "0"), "--shutdown-timeout") == "0"
    assert args[-3:] == ["--module", "accel.launch.worker", "train.py"]


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_plan_refuses_a_bad_grace_period(bad: str) -> None:
    with pytest.raises(ConfigError, match=rf"--stop-grace-period={float(bad)!r} must be"):
        _plan_args("--stop-grace-period", bad)


def test_a_bad_grace_period_is_reported_by_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = call_accel(tmp_path, monkeypatch, "launch", "--stop-grace-period", "-5", "train.py")
    assert done.returncode == 2
    assert "accel launch: error: --stop-grace-period=-5.0 must be" in done.stderr


def test_stop_outcome() -> None:
    text, code = stop_outcome(signal.SIGTERM, {0: 0, 1: 0}, 60.0)
    assert code == 0 and text == "accel launch: stopped by SIGTERM: all 2 workers exited 0.\n"
    text, code = stop_outcome(signal.SIGUSR1, {0: 0, 1: 3, 2: -9, 3: None}, 2.5)
    assert code == 128 + signal.SIGUSR1
    assert text.splitlines() == [
        "accel launch: stopped by SIGUSR1; workers terminated.",
        "accel launch: local rank 0: exit code 0",
        "accel launch: local rank 1: exit code 3",
        "accel launch: local rank 2: killed by signal SIGKILL (still running after the 2.5 s "
        "grace period, or a second signal: give more time with `--stop-grace-period SECONDS`)",
        "accel launch: local rank 3: still running",
    ]
    # stopped before any worker ran (e.g. during the rendezvous): the signal's exit code
    assert stop_outcome(signal.SIGINT, {}, 60.0)[1] == 128 + signal.SIGINT


def test_stop_options_this_torch_lacks_are_dropped_with_a_note() -> None:
    args = ["--nnodes", "1", "--signals-to-handle", "SIGTERM,SIGUSR1", "--shutdown-timeout",
            "60", "--module", "accel.launch.worker", "x.py", "--shutdown-timeout", "7"]
    assert supported_stop_args(args) == (args, 60.0, "")  # this torch has both
    kept, grace, note = supported_stop_args(args, known={"--nnodes", "--signals-to-handle"})
    assert kept == ["--nnodes", "1", "--signals-to-handle", "SIGTERM,SIGUSR1", "--module",
                    "accel.launch.worker", "x.py", "--shutdown-timeout", "7"]  # script's kept
    assert grace == 30.0
    assert "has no --shutdown-timeout: on SIGTERM/SIGINT the workers get its own fixed 30 s" in note
    assert "SIGUSR1" not in note
    kept, grace, note = supported_stop_args(args, known={"--nnodes"})
    assert kept == ["--nnodes", "1", "--module", "accel.launch.worker", "x.py",
                    "--shutdown-timeout", "7"]
    assert "--signals-to-handle or --shutdown-timeout" in note
    assert "SIGUSR1 is not passed on" in note


PIPELINE_SCRIPT = '''
import sys, time
from pathlib import Path
import torch
from torch import nn
import accel


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


root, total, delay = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
with accel.distributed(seed=0) as st:
    torch.manual_seed(0)
    model = accel.prepare_model(Stack(), pp_plan="auto", pp_schedule="1F1B", microbatches=2)
    optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    info = accel.load_state(root / "ckpt", missing_ok=True, model=model, optimizer=optimizer)
    step = info.step if info else 0
    print(f"starting at step {step} on stage {st.pp_rank} of {st.pp_world_size}", flush=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(total * 4, 4, generator=g), torch.randn(total * 4, 2, generator=g)
    while step < total:
        batch = slice(step * 4, step * 4 + 4)
        loss = accel.pipeline_step(model, x[batch], y[batch], loss_fn=nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        accel.print(f"LOSS {step} {float(loss)!r}", flush=True)  # the same on every rank
        time.sleep(delay)
        if step < total and accel.stop_requested():
            accel.save_state(root / "ckpt", step=step, model=model, optimizer=optimizer)
            print(f"SAVED {st.rank} {step}", flush=True)
            break
    else:
        accel.save_model(model, root / "final")
        print(f"finished at step {step}", flush=True)
'''


def _losses(output: str) -> dict[int, str]:
    """step -> the loss as rank 0 printed it (repr: every bit)."""
    found = re.findall(r"LOSS (\d+) (\d+\.\d+(?:e-?\d+)?)", output)
    return {int(step): loss for step, loss in found}


@pytest.mark.ci_extra
@pytest.mark.slow
def test_sigterm_to_a_pipelined_launch_saves_every_stage_and_the_relaunch_ends_the_same(
    tmp_path: Path,
) -> None:
    # `accel launch --pp-size 2`: both stages stop at one step and save their pieces into one
    # checkpoint; the relaunch resumes it and ends with the uninterrupted run's losses and
    # weights, bit for bit
    script = write_script(tmp_path, PIPELINE_SCRIPT)
    env = {**clean_env_changes(tmp_path), "ACCEL_PP_SIZE": "2"}
    straight = run_script(script, str(tmp_path / "straight"), "20", "0", world_size=2,
                          cwd=tmp_path, env=env).output
    assert "starting at step 0 on stage 1 of 2" in straight and "finished at step 20" in straight

    first = Launched(["--nproc-per-node", "2", "--cpu", "--pp-size", "2", str(script),
                      str(tmp_path / "stopped"), "20", "0.05"], tmp_path)
    first.wait_for("LOSS 4 ")
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 0, first.output[-3000:]
    saved = re.findall(r"SAVED (\d) (\d+)", first.output)
    assert sorted(rank for rank, _ in saved) == ["0", "1"], first.output[-3000:]
    assert len({step for _, step in saved}) == 1  # every stage at the same step
    stopped_at = int(saved[0][1])
    assert 4 <= stopped_at < 20 and "finished at step" not in first.output
    ckpt = tmp_path / "stopped" / "ckpt"
    from accel.cli.main import main

    assert main(["checkpoint", "verify", str(ckpt)]) == 0  # every stage's pieces, each once

    second = run_script(script, str(tmp_path / "stopped"), "20", "0", world_size=2,
                        cwd=tmp_path, env=env).output
    assert f"starting at step {stopped_at} on stage 0 of 2" in second
    assert "finished at step 20" in second

    want, before, after = _losses(straight), _losses(first.output), _losses(second)
    assert len(want) == 20 and set(before) | set(after) == set(want)
    assert {k: want[k] for k in before} == before and {k: want[k] for k in after} == after
    expected, got = _final_weights(tmp_path / "straight"), _final_weights(tmp_path / "stopped")
    assert expected.keys() == got.keys() and len(expected) == 20  # every stage's weights
    for name in expected:
        assert torch.equal(expected[name], got[name]), name

"""`accel launch` as subprocesses (real workers through torch's elastic agent): options,
free ports, failure reports, restarts, machines. Where only the command's parsing or planning
is under test, the command runs in-process and the workers fork from warm ones (run_script)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import accel.launch.run
from accel.launch.run import LaunchPlan
from accel.testing import run_script
from tests.cli._helpers import (
    TRAIN_SCRIPT,
    accel_command,
    call_accel,
    clean_env,
    clean_env_changes,
    results,
    run_accel,
    write_script,
)


@pytest.mark.slow
@pytest.mark.ci_extra
def test_two_cpu_processes_train_with_options(tmp_path: Path) -> None:
    write_script(tmp_path)
    done = run_accel(tmp_path, "launch", "--nproc-per-node", "2", "--mixed-precision", "bf16",
                     "--gradient-accumulation-steps", "4", "train.py", "--epochs", "1")
    assert done.returncode == 0, done.stdout
    ranks = results(done.stdout)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["world"] == 2
        assert r["backend"] == "gloo"
        assert r["device"] == "cpu"
        assert r["mixed_precision"] == "bf16"
        assert r["gradient_accumulation_steps"] == 4
        assert r["strategy"] == "ddp"
        assert r["ranks"] == [0, 1]
        assert r["argv"] == ["--epochs", "1"]
        assert r["omp"] is not None
        assert int(r["omp"]) >= 1
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the averaged gradients kept them in sync


@pytest.mark.slow
def test_accelerate_flags_and_module_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_script(tmp_path)
    # `python -m accel.cli script.py` (no subcommand) is `accel launch script.py`: planned
    # in-process (--dry-run), then the planned workers' variables run the script, forked
    planned = call_accel(tmp_path, monkeypatch, "--num_processes", "2", "--num_machines", "1",
                         "--mixed_precision", "fp16", "--gradient_accumulation_steps", "2",
                         "--cpu", "--multi_gpu", "--dry-run", "train.py", module=True)
    assert planned.returncode == 0, planned.stdout
    plan = json.loads(planned.stdout)
    assert plan["nproc_per_node"] == 2
    done = run_script(tmp_path / "train.py", world_size=plan["nproc_per_node"], cwd=tmp_path,
                      env={**clean_env_changes(tmp_path), **plan["worker_env"]})
    ranks = results(done.output)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {(r["mixed_precision"], r["gradient_accumulation_steps"]) for r in ranks} == {
        ("fp16", 2)
    }


@pytest.mark.ci_extra
@pytest.mark.slow
def test_two_launches_at_once_use_different_free_ports(tmp_path: Path) -> None:
    write_script(tmp_path)
    env = clean_env(tmp_path)
    command = accel_command("launch", "--nproc-per-node", "2", "train.py")
    procs = [subprocess.Popen(command, cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    ports = [{r["port"] for r in results(output)} for output in outputs]
    assert all(len(p) == 1 for p in ports)
    assert ports[0] != ports[1]


@pytest.mark.slow
@pytest.mark.ci_extra
def test_a_failing_rank_is_reported_with_its_traceback(tmp_path: Path) -> None:
    write_script(tmp_path, text=(
        "import accel\n"
        "def load_batch(rank):\n"
        "    raise ValueError(f'corrupt shard on rank {rank}')\n"
        "with accel.distributed() as st:\n"
        "    if st.rank == 1:\n"
        "        load_batch(st.rank)\n"
        "    accel.wait_for_everyone()\n"
    ))
    done = run_accel(tmp_path, "launch", "--nproc-per-node", "2", "train.py")
    assert done.returncode == 1
    out = done.stdout
    assert "train.py failed on rank 1 (local rank 1" in out
    assert "raised ValueError: corrupt shard on rank 1" in out
    assert "----- traceback of rank 1 -----" in out
    report = out.split("----- traceback of rank 1 -----", 1)[1]
    assert "in load_batch" in report
    assert "ValueError: corrupt shard on rank 1" in report
    assert "error_file: <N/A>" not in out


@pytest.mark.ci_extra
@pytest.mark.slow
def test_a_killed_rank_restarts_and_the_job_completes(tmp_path: Path) -> None:
    marker = tmp_path / "killed-once"
    write_script(tmp_path, text=TRAIN_SCRIPT.replace(
        "with accel.distributed() as st:\n",
        "with accel.distributed() as st:\n"
        "    import signal\n"
        f"    if st.rank == 1 and not os.path.exists({str(marker)!r}):\n"
        f"        open({str(marker)!r}, 'w').close()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n",
    ))
    done = run_accel(tmp_path, "launch", "--nproc-per-node", "2", "--max-restarts", "1",
                     "train.py")
    assert done.returncode == 0, done.stdout
    assert marker.exists()
    ranks = results(done.stdout)
    assert [(r["rank"], r["restart"]) for r in ranks] == [(0, "1"), (1, "1")]
    # without restarts the same kill fails the job with the signal named
    marker.unlink()
    failed = run_accel(tmp_path, "launch", "--nproc-per-node", "2", "train.py")
    assert failed.returncode == 128 + 9
    assert "rank 1 (local rank 1" in failed.stdout
    assert "SIGKILL" in failed.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.ci_extra  # a whole launch: ~5-8 s
def test_two_machines_on_one_host_train_together(tmp_path: Path) -> None:
    write_script(tmp_path)
    env = clean_env(tmp_path)
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            accel_command("launch", "--nnodes", "2", "--node-rank", str(node),
                          "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                          "--master-port", port, "train.py"),
            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    node0, node1 = (results(output) for output in outputs)
    assert [(r["rank"], r["node_rank"], r["num_nodes"]) for r in node0] == [(0, 0, 2)]
    assert [(r["rank"], r["node_rank"], r["num_nodes"]) for r in node1] == [(1, 1, 2)]
    assert node0[0]["world"] == node1[0]["world"] == 2
    assert node0[0]["weights"] == node1[0]["weights"]  # trained together, agree


def _run_plan_forked(plan: LaunchPlan, what: str) -> int:
    """`run_plan`, with the planned workers forked by run_script instead of torchrun's."""
    args = list(plan.torchrun_args)
    script, *script_args = args[args.index("accel.launch.worker") + 1:]
    done = run_script(script, *script_args, world_size=plan.nproc_per_node,
                      env=dict(plan.worker_env), check=False)
    print(done.output, end="")
    return next((code for code in done.exit_codes if code != 0), 0)


@pytest.mark.parametrize("nproc", [2, 3])
def test_selftest_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int) -> None:
    # `accel test` in-process: its plan and report; the self-check forked on warm workers
    monkeypatch.setattr(accel.launch.run, "run_plan", _run_plan_forked)
    done = call_accel(tmp_path, monkeypatch, "test", "--nproc-per-node", str(nproc))
    assert done.returncode == 0, done.stdout
    assert f"all checks passed on {nproc} process(es)" in done.stdout
    assert "ok  collectives" in done.stdout
    assert "ok  checkpoint round trip" in done.stdout
    assert done.stdout.rstrip().endswith("accel test: PASS")


def test_invalid_options_are_reported_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = call_accel(tmp_path, monkeypatch, "launch", "--mixed-precision", "fp32", "train.py")
    assert done.returncode == 2
    assert "accel launch: error:" in done.stdout
    assert "mixed_precision='fp32'" in done.stdout
    assert "Traceback" not in done.stdout


def test_the_command_process_ends_without_the_interpreter_teardown(tmp_path: Path) -> None:
    # exit_process: threads joined, exit functions run, streams flushed, the code kept
    code = (
        "import atexit, sys, threading, time\n"
        "from accel.cli.main import exit_process\n"
        "atexit.register(lambda: print('exit function ran', flush=False))\n"
        "class Loud:\n"
        "    def __del__(self): print('teardown ran')\n"
        "keep = Loud()\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
        "print('unflushed', end='')\n"
        "sys.stderr.write('to stderr')\n"
        "exit_process(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 3
    assert done.stdout == "unflushedthread done\nexit function ran\n"  # no 'teardown ran'
    assert done.stderr == "to stderr"


def test_the_console_script_and_the_module_end_through_exit_process() -> None:
    import tomllib

    import accel.cli.__main__ as module_entry

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["accel"] == "accel.cli.main:script_main"
    assert "exit_process(module_main())" in Path(module_entry.__file__).read_text()

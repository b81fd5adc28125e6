"""`accel launch` planning (options -> torchrun arguments and worker variables), failure reports,
and the worker entry point. No workers are started here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from accel.cli.main import build_parser
from accel.core.env import LaunchEnv
from accel.errors import ConfigError
from accel.launch.run import LaunchPlan, describe_failure, is_peer_loss, plan_launch
from tests.cli._helpers import clean_env


def plan(*argv: str, gpus: int = 0, file: dict[str, object] | None = None,
         env: LaunchEnv | None = None, omp: bool = False, cpus: int = 8) -> LaunchPlan:
    ns = build_parser().parse_args(["launch", *argv])
    return plan_launch(ns, env=env or LaunchEnv(), file_settings=file or {}, config_file=None,
                       gpu_count=lambda: gpus, cpu_count=cpus, omp_num_threads_set=omp)


def arg(plan_: LaunchPlan, flag: str) -> str:
    args = list(plan_.torchrun_args)
    return args[args.index(flag) + 1]


def test_defaults_on_cpu_two_processes_free_port() -> None:
    p = plan("train.py", "--lr", "1")
    assert p.nproc_per_node == 2
    assert p.nnodes == "1"
    assert "--standalone" in p.torchrun_args  # c10d on localhost:0: the OS picks the port
    assert "--master-port" not in p.torchrun_args
    assert p.torchrun_args[-5:] == ("--module", "accel.launch.worker", "train.py", "--lr", "1")
    assert p.worker_env == {"ACCEL_CPU": "1", "OMP_NUM_THREADS": "4"}


def test_defaults_with_gpus_one_process_each() -> None:
    p = plan("train.py", gpus=4, cpus=32)
    assert p.nproc_per_node == 4
    assert "ACCEL_CPU" not in p.worker_env
    assert p.worker_env["OMP_NUM_THREADS"] == "8"
    assert plan("--cpu", "train.py", gpus=4).nproc_per_node == 2
    assert "OMP_NUM_THREADS" not in plan("train.py", omp=True).worker_env


def test_accelerate_spellings() -> None:
    p = plan("--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
             "--main_process_ip", "10.0.0.1", "--main_process_port", "1234",
             "--mixed_precision", "fp16", "--gradient_accumulation_steps", "2", "--multi_gpu",
             "--use_fsdp", "train.py", "--mixed_precision", "bf16")
    assert p.nproc_per_node == 2
    assert (arg(p, "--nnodes"), arg(p, "--node-rank")) == ("2", "1")
    assert (arg(p, "--master-addr"), arg(p, "--master-port")) == ("10.0.0.1", "1234")
    assert p.worker_env["ACCEL_MIXED_PRECISION"] == "fp16"
    assert p.worker_env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert p.worker_env["ACCEL_STRATEGY"] == "fsdp"
    assert p.torchrun_args[-2:] == ("--mixed_precision", "bf16")  # the script's own option


def test_torchrun_spellings_and_passthrough() -> None:
    p = plan("--nproc_per_node", "3", "--nnodes", "1:4", "--rdzv-endpoint", "host:29400",
             "--rdzv-id", "job7", "--max-restarts", "2", "--monitor-interval", "0.5",
             "--log-dir", "/tmp/logs", "--tee", "3", "-m", "pkg.train", "x")
    assert p.nproc_per_node == 3
    assert p.nnodes == "1:4"
    assert (arg(p, "--rdzv-backend"), arg(p, "--rdzv-endpoint")) == ("c10d", "host:29400")
    assert (arg(p, "--rdzv-id"), arg(p, "--max-restarts")) == ("job7", "2")
    assert (arg(p, "--log-dir"), arg(p, "--tee")) == ("/tmp/logs", "3")
    assert p.torchrun_args[-4:] == ("accel.launch.worker", "-m", "pkg.train", "x")
    # restarts with a c10d store: a fresh store per attempt (torch reuses stale keys otherwise)
    assert p.worker_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plan("train.py").worker_env


def test_one_machine_with_a_port_uses_it() -> None:
    p = plan("--master-port", "29555", "train.py")
    assert "--standalone" not in p.torchrun_args
    assert (arg(p, "--master-addr"), arg(p, "--master-port")) == ("127.0.0.1", "29555")


def test_layers_reach_the_workers() -> None:
    env = LaunchEnv(gradient_accumulation_steps=3)
    file = {"mixed_precision": "bf16", "gradient_accumulation_steps": 8, "num_processes": 3,
            "debug": True, "max_restarts": 1}
    p = plan("--debug", "train.py", env=env, file=file)
    assert p.nproc_per_node == 3
    assert arg(p, "--max-restarts") == "1"
    assert p.worker_env["ACCEL_MIXED_PRECISION"] == "bf16"
    assert p.worker_env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] == "3"
    assert p.worker_env["ACCEL_DEBUG"] == "1"
    assert p.settings["debug"].source == "command line"
    assert p.settings["num_processes"].source == "config file"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (("--nnodes", "2", "train.py"), "needs the address of machine 0"),
        (("--num_processes", "3", "--nnodes", "2", "--master-addr", "h", "train.py"),
         "not a multiple"),
        (("--nnodes", "0", "train.py"), "num_machines='0' is invalid"),
        (("--nproc-per-node", "0", "train.py"), "must be >= 1"),
        (("--mixed-precision", "fp32", "train.py"), "mixed_precision='fp32'"),
        (("--standalone", "--nnodes", "2", "train.py"), "one machine"),
        (("--no-python", "-m", "train.py"), "not both"),
    ],
)
def test_contradictions_are_config_errors(argv: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(*argv)


def _failure(tmp_path: Path, rank: int, exitcode: int, trace: str | None,
             when: float) -> ProcessFailure:
    error_file = tmp_path / f"error{rank}.json"
    if trace is not None:
        error_file.write_text(json.dumps({"message": {
            "message": trace.splitlines()[-1],
            "extraInfo": {"py_callstack": trace, "timestamp": str(int(when)),
                          "accel_time": repr(when)},
        }}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(error_file))


def test_failure_report_names_the_root_cause(tmp_path: Path) -> None:
    lost = "Traceback (most recent call last):\nRuntimeError: Connection reset by peer [x]\n"
    real = 'Traceback (most recent call last):\n  File "t.py", line 3\nValueError: boom\n'
    failures: dict[int, Any] = {
        0: _failure(tmp_path, 0, 1, lost, 100.1),  # noticed first, but only a lost peer
        1: _failure(tmp_path, 1, 3, real, 100.2),
        2: _failure(tmp_path, 2, -15, None, 100.3),
    }
    text, code = describe_failure(ChildFailedError("t.py", failures), "t.py")
    assert code == 3
    assert ("failed on rank 1 (local rank 1, pid 1001): raised ValueError: boom (exit code 3)"
            " (first failure)") in text
    assert "rank 2 (local rank 2, pid 1002): killed by signal SIGTERM" in text
    assert "traceback of rank 1" in text
    assert "ValueError: boom" in text
    assert "Connection reset" not in text.split("traceback of rank 1", 1)[1]


def test_a_rank_the_launcher_stopped_is_not_the_root_cause(tmp_path: Path) -> None:
    real = 'Traceback (most recent call last):\n  File "t.py", line 3\nValueError: boom\n'
    failures: dict[int, Any] = {
        0: _failure(tmp_path, 0, -15, None, 99.0),  # SIGTERM from the agent, same second
        1: _failure(tmp_path, 1, 1, real, 100.0),
    }
    failures[0].timestamp = 99  # torch stamps a signal death with whole seconds: earlier
    text, code = describe_failure(ChildFailedError("t.py", failures), "t.py")
    assert code == 1
    assert "traceback of rank 1" in text and "ValueError: boom" in text


def test_failure_report_for_a_killed_rank(tmp_path: Path) -> None:
    failures: dict[int, Any] = {1: _failure(tmp_path, 1, -9, None, 5.0)}
    text, code = describe_failure(ChildFailedError("t.py", failures), "t.py")
    assert code == 128 + 9
    assert "killed by signal SIGKILL" in text
    assert "no Python exception" in text


def test_peer_loss_detection() -> None:
    assert is_peer_loss("x\nRuntimeError: [pair.cc:537] Read error: Connection reset by peer.")
    assert not is_peer_loss("Connection reset by peer\nValueError: mine")


def test_worker_runs_script_and_records_trimmed_traceback(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(
        "import sys\n"
        f"print('argv', sys.argv, 'path0', sys.path[0] == {str(tmp_path)!r})\n"
        "def f():\n    raise ValueError('boom')\n"
        "if __name__ == '__main__' and 'fail' in sys.argv:\n    f()\n"
    )
    error_file = tmp_path / "err.json"
    env = clean_env(tmp_path, TORCHELASTIC_ERROR_FILE=str(error_file))
    ok = subprocess.run([sys.executable, "-m", "accel.launch.worker", str(script), "a"],
                        env=env, capture_output=True, text=True, timeout=30, check=False)
    assert ok.returncode == 0, ok.stderr
    assert f"argv ['{script}', 'a'] path0 True" in ok.stdout
    assert not error_file.exists()
    bad = subprocess.run([sys.executable, "-m", "accel.launch.worker", str(script), "fail"],
                         env=env, capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode == 1
    assert "ValueError: boom" in bad.stderr
    assert "runpy" not in bad.stderr
    assert 'in f\n    raise ValueError' in bad.stderr
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "ValueError: boom"
    callstack = data["message"]["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback")
    assert "worker.py" not in callstack


def test_mesh_sizes_reach_the_workers_in_every_spelling() -> None:
    for argv in (["--tp-size", "2", "--dp-shard-size", "2", "--dp-replicate-size", "1"],
                 ["--parallelism_config_tp_size", "2", "--parallelism_config_dp_shard_size", "2",
                  "--parallelism_config_dp_replicate_size", "1", "--use_parallelism_config"]):
        p = plan("--nproc-per-node", "4", *argv, "train.py")
        assert {k: v for k, v in p.worker_env.items() if k.endswith("_SIZE")} == {
            "ACCEL_TP_SIZE": "2", "ACCEL_DP_SHARD_SIZE": "2", "ACCEL_DP_REPLICATE_SIZE": "1"}
    p = plan("train.py", file={"tp_size": 2})  # the config file's key, passed on the same way
    assert p.worker_env["ACCEL_TP_SIZE"] == "2"


def test_the_fp8_recipe_reaches_the_workers() -> None:
    for spelling in ("--fp8_recipe", "--fp8-recipe"):
        p = plan("--mixed_precision", "fp8", spelling, "RowWise", "train.py")
        assert p.worker_env["ACCEL_MIXED_PRECISION"] == "fp8"
        assert p.worker_env["ACCEL_FP8_RECIPE"] == "rowwise"
        assert p.settings["fp8_recipe"].source == "command line"
    file = plan("train.py", file={"fp8_recipe": "rowwise"})  # the workers read the file
    assert file.settings["fp8_recipe"].value == "rowwise"
    assert "ACCEL_FP8_RECIPE" not in file.worker_env
    assert plan("train.py").settings["fp8_recipe"].value == "tensorwise"
    with pytest.raises(ConfigError, match=r"fp8_recipe='blockwise'.*\['tensorwise', 'rowwise'\]"):
        plan("--fp8_recipe", "blockwise", "train.py")


def test_deepspeed_flags_reach_the_workers() -> None:
    p = plan("--use_deepspeed", "--deepspeed_config_file", "ds.json", "--zero_stage", "3",
             "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu",
             "--gradient_clipping", "1.0", "--gradient_accumulation_steps", "2", "train.py")
    assert p.worker_env["ACCEL_STRATEGY"] == "deepspeed"
    assert p.worker_env["ACCEL_DEEPSPEED_CONFIG"] == "ds.json"
    assert p.worker_env["ACCEL_ZERO_STAGE"] == "3"
    assert p.worker_env["ACCEL_OFFLOAD_OPTIMIZER"] == "cpu"
    assert p.worker_env["ACCEL_OFFLOAD_PARAMS"] == "cpu"
    assert p.worker_env["ACCEL_GRADIENT_CLIPPING"] == "1.0"
    assert p.worker_env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] == "2"
    assert plan("--strategy", "deepspeed", "train.py").worker_env["ACCEL_STRATEGY"] == "deepspeed"
    with pytest.raises(ConfigError, match=r"zero_stage=4 is invalid"):
        plan("--use_deepspeed", "--zero_stage", "4", "train.py")
    with pytest.raises(ConfigError, match=r"offload_optimizer='disk' is invalid"):
        plan("--use_deepspeed", "--offload_optimizer_device", "disk", "train.py")

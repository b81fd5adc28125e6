"""accel.testing.run_script: a script's __main__ on N warm forked processes, as accel launch."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accel.errors import CollectiveTimeoutError, ConfigError, LaunchError
from accel.testing import ScriptResult, preload, run_script, start_script

# What a launched worker sees: its variables (those the launcher added), its place, its state.
REPORT = '''
import json, os, sys
import torch
import accel
import helper  # a module next to the script: sys.path[0] is the script's directory

base = set(json.loads(os.environ["BASE_KEYS"]))
added = {k: v for k, v in sorted(os.environ.items()) if k not in base}
with accel.distributed() as st:
    info = {
        "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
        "helper": helper.VALUE, "added": added, "threads": torch.get_num_threads(),
        "rank": st.rank, "world": st.world_size, "local_rank": st.local_rank,
        "local_world": st.local_world_size, "node_rank": st.node_rank,
        "num_nodes": st.num_nodes, "backend": st.backend, "device": str(st.device),
        "mixed_precision": st.mixed_precision,
        "accumulation": st.gradient_accumulation_steps,
        "ranks": accel.gather_object(st.rank),
    }
    print("RESULT " + json.dumps(info), flush=True)
    print(f"to stderr from rank {st.rank}", file=sys.stderr)
'''

# the variables whose values differ from one launch to the next
_PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def _write(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _report_script(tmp_path: Path) -> Path:
    _write(tmp_path, "VALUE = 42\n", "helper.py")
    return _write(tmp_path, REPORT)


def _base_env(tmp_path: Path) -> dict[str, str | None]:
    """Variables that make the runs comparable: a private config dir, the keys seen before."""
    env: dict[str, str | None] = {"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "BASE_KEYS": ""}
    env["BASE_KEYS"] = json.dumps(sorted(set(os.environ) | set(env)))
    return env


def _records(text: str) -> list[dict[str, Any]]:
    """The RESULT records, by rank (under accel launch the ranks share a pipe: two records
    may land on one line, so each is decoded from its marker to the end of its object)."""
    decoder = json.JSONDecoder()
    found = []
    start = text.find("RESULT ")
    while start != -1:
        record, end = decoder.raw_decode(text, start + len("RESULT "))
        found.append(record)
        start = text.find("RESULT ", end)
    return sorted(found, key=lambda r: int(r["rank"]))


def test_the_script_runs_as_main_on_every_rank(tmp_path: Path) -> None:
    script = _report_script(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    result = run_script(script, "--epochs", "1", world_size=2, cwd=work,
                        env=_base_env(tmp_path))
    assert isinstance(result, ScriptResult)
    assert result.exit_codes == (0, 0) and result.ok
    assert result.failed_rank is None and result.traceback is None and not result.timed_out
    per_rank = [_records(out) for out in result.stdout]
    assert [[r["rank"] for r in records] for records in per_rank] == [[0], [1]]
    assert result.output == result.stdout[0] + result.stdout[1]
    assert [line.strip() for line in result.stderr] == [
        "to stderr from rank 0", "to stderr from rank 1"]
    for rank, (info,) in enumerate(per_rank):
        assert info["name"] == "__main__"
        assert info["argv"] == [str(script), "--epochs", "1"]
        assert info["cwd"] == str(work)
        assert info["path0"] == str(tmp_path)
        assert info["helper"] == 42
        assert (info["rank"], info["local_rank"], info["world"], info["local_world"]) == (
            rank, rank, 2, 2)
        assert (info["node_rank"], info["num_nodes"]) == (0, 1)
        assert (info["backend"], info["device"]) == ("gloo", "cpu")
        assert info["ranks"] == [0, 1]
        added = info["added"]
        assert added["RANK"] == added["LOCAL_RANK"] == str(rank)
        assert added["WORLD_SIZE"] == added["LOCAL_WORLD_SIZE"] == "2"
        assert added["ACCEL_CPU"] == "1"
        assert added["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert int(added["OMP_NUM_THREADS"]) >= 1
        assert info["threads"] == int(added["OMP_NUM_THREADS"])


def test_a_relative_script_path_is_found_from_cwd(tmp_path: Path) -> None:
    _report_script(tmp_path)
    result = run_script("train.py", world_size=1, cwd=tmp_path, env=_base_env(tmp_path))
    (info,) = _records(result.output)
    # accel.launch.worker runs the script by its absolute path (runpy sets it as argv[0])
    assert info["argv"] == [str(tmp_path / "train.py")]
    assert info["world"] == 1 and info["ranks"] == [0]


@pytest.mark.parametrize("world_size", [1, 3])
def test_other_world_sizes(tmp_path: Path, world_size: int) -> None:
    script = _report_script(tmp_path)
    result = run_script(script, world_size=world_size, env=_base_env(tmp_path))
    records = _records(result.output)
    assert [r["rank"] for r in records] == list(range(world_size))
    assert all(r["ranks"] == list(range(world_size)) for r in records)


def test_env_and_the_config_file_reach_the_workers_as_with_accel_launch(tmp_path: Path) -> None:
    script = _report_script(tmp_path)
    config = tmp_path / "xdg" / "accel" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("gradient_accumulation_steps = 2\n")
    env = {**_base_env(tmp_path), "ACCEL_MIXED_PRECISION": "bf16", "OMP_NUM_THREADS": "1"}
    result = run_script(script, env=env)
    for info in _records(result.output):
        assert (info["mixed_precision"], info["accumulation"]) == ("bf16", 2)
        assert info["threads"] == 1
        assert info["added"]["ACCEL_CONFIG_FILE"] == str(config)


def test_a_none_in_env_removes_the_variable(tmp_path: Path) -> None:
    script = _write(tmp_path, "import os\nprint(os.environ.get('PATH'), os.environ['KEPT'])\n")
    result = run_script(script, world_size=1, env={"PATH": None, "KEPT": "yes"})
    assert result.output == "None yes\n"


def test_system_exit_codes_are_exit_codes(tmp_path: Path) -> None:
    script = _write(tmp_path, (
        "import sys, accel\n"
        "with accel.distributed() as st:\n"
        "    accel.wait_for_everyone()\n"
        "sys.exit({0: None, 1: 3, 2: 0}[st.rank])\n"
    ))
    result = run_script(script, world_size=3, check=False)
    assert result.exit_codes == (0, 3, 0)
    assert not result.ok and result.failed_rank == 1 and result.traceback is None
    with pytest.raises(LaunchError, match=r"train\.py failed on rank 1 of 3: exit code 3"):
        result.check()
    with pytest.raises(LaunchError, match="rank 1 of 3: exit code 3") as info:
        run_script(script, world_size=3)
    assert "exit codes by rank: 0, 3, 0" in str(info.value)
    # a message instead of a number: printed to stderr, exit code 1 (as Python does)
    message = _write(tmp_path, "import sys\nsys.exit('stopped: no data')\n", "stop.py")
    stopped = run_script(message, world_size=1, check=False)
    assert stopped.exit_codes == (1,) and stopped.stderr == ("stopped: no data\n",)


FAILING = '''
import accel

def load_batch(rank):
    raise ValueError(f"corrupt shard on rank {rank}")

with accel.distributed() as st:
    print(f"started {st.rank}", flush=True)
    if st.rank == 1:
        load_batch(st.rank)
    accel.wait_for_everyone()
'''


@pytest.mark.ci_extra
def test_the_failing_ranks_traceback_is_raised(tmp_path: Path) -> None:
    script = _write(tmp_path, FAILING)
    with pytest.raises(LaunchError) as info:
        run_script(script, world_size=2)
    message = str(info.value)
    assert "train.py failed on rank 1 of 2: raised ValueError: corrupt shard on rank 1" in message
    report = message.split("----- traceback of rank 1 -----", 1)[1]
    assert "in load_batch" in report
    assert "runpy" not in report  # trimmed to the user's frames, as accel launch shows it
    result = run_script(script, world_size=2, check=False)
    assert result.failed_rank == 1 and result.exit_codes[1] == 1
    assert result.traceback is not None
    assert result.traceback.rstrip().endswith("ValueError: corrupt shard on rank 1")
    assert [out.splitlines()[0] for out in result.stdout] == ["started 0", "started 1"]
    assert "ValueError: corrupt shard on rank 1" in result.stderr[1]


@pytest.mark.slow
def test_a_hung_rank_is_killed_at_the_timeout(tmp_path: Path) -> None:
    script = _write(tmp_path, (
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "print(f'waiting on rank {rank}')\n"  # not flushed: workers' output is line-buffered
        "if rank == 1:\n"
        "    time.sleep(600)\n"
    ))
    result = run_script(script, world_size=2, timeout=3, check=False)
    assert result.timed_out and not result.ok
    assert result.exit_codes == (0, -9) and result.killed == (1,)
    assert result.stdout == ("waiting on rank 0\n", "waiting on rank 1\n")
    # before the kill, the hung rank wrote where it was (faulthandler) to its stderr
    assert f'File "{script}", line 5 in <module>' in result.stderr[1]
    with pytest.raises(CollectiveTimeoutError, match=r"timeout=3.*ranks \[1\]") as info:
        result.check()
    assert "waiting on rank 1" in str(info.value)  # the hung rank's last output and stack
    assert "line 5 in <module>" in str(info.value)
    assert multiprocessing.active_children() == []


LOOP = '''
import os, time
for step in range(10_000):
    print(f"step {step} on rank {os.environ.get('RANK')}")
    time.sleep(0.01)
'''


def test_start_script_gives_a_handle_on_the_running_ranks(tmp_path: Path) -> None:
    script = _write(tmp_path, LOOP)
    with start_script(script, world_size=2) as run:
        run.wait_for("step 3 on rank 1", rank=1)
        run.wait_for("step 2 on rank 0")
        assert "step 1 on rank 1" in run.stdout(1) and run.stderr(0) == ""
        run.send_signal(signal.SIGTERM)
        result = run.wait(check=False)
    assert result.exit_codes == (-signal.SIGTERM, -signal.SIGTERM)
    assert result.failed_rank is not None and not result.timed_out
    assert result.stdout[1].startswith("step 0 on rank 1\nstep 1 on rank 1\n")
    assert multiprocessing.active_children() == []


def test_wait_for_reports_a_rank_that_ended_first(tmp_path: Path) -> None:
    script = _write(tmp_path, "print('only this')\n")
    with start_script(script, world_size=1) as run, pytest.raises(
            LaunchError, match=r"rank 0 of train\.py ended \(exit code 0\) before printing "
                               r"'never' x1(.|\n)*only this"):
        run.wait_for("never")
    with start_script(_write(tmp_path, LOOP, "loop.py"), world_size=1) as run, pytest.raises(
            CollectiveTimeoutError, match="did not print 'never' x1 in time"):
        run.wait_for("never", timeout=0.5)


def test_launch_false_runs_it_as_plain_python(tmp_path: Path) -> None:
    script = _write(tmp_path, (
        "import os, sys\n"
        "import accel\n"
        "print(__name__, sys.argv[1:], os.environ.get('RANK'), os.environ.get('ACCEL_CPU'))\n"
        "with accel.distributed() as st:\n"
        "    print(st.world_size, st.backend)\n"
        "def fail():\n"
        "    raise KeyError('no such column')\n"
        "fail()\n"
    ))
    result = run_script(script, "a", launch=False, world_size=1, check=False)
    assert result.stdout == ("__main__ ['a'] None None\n1 None\n",)
    assert result.exit_codes == (1,) and result.failed_rank == 0
    assert result.traceback is not None and "in fail" in result.traceback
    assert result.traceback.rstrip().endswith("KeyError: 'no such column'")
    with pytest.raises(ConfigError, match=r"launch=False runs the script as `python script\.py`"):
        run_script(script, launch=False)  # world_size=2


def test_an_uncaught_keyboard_interrupt_ends_as_python_or_the_launched_worker_does(
    tmp_path: Path,
) -> None:
    script = _write(tmp_path, "raise KeyboardInterrupt\n")
    plain = run_script(script, world_size=1, launch=False, check=False)
    assert plain.exit_codes == (-signal.SIGINT,)  # CPython re-raises the signal
    assert plain.stderr[0].rstrip().endswith("KeyboardInterrupt")
    launched = run_script(script, world_size=1, check=False)
    assert launched.exit_codes == (130,)  # accel.launch.worker's exit status


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="world_size=0"):
        run_script(_write(tmp_path, "pass\n"), world_size=0)
    with pytest.raises(ConfigError, match=r"missing\.py"):
        run_script(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match="timeout=-1"):
        run_script(_write(tmp_path, "pass\n"), timeout=-1)


@pytest.mark.slow
@pytest.mark.ci_extra
def test_same_variables_and_state_as_accel_launch(tmp_path: Path) -> None:
    """The reference: the same script under the real `accel launch --nproc-per-node 2 --cpu`."""
    script = _report_script(tmp_path)
    env = _base_env(tmp_path)
    forked = _records(run_script(script, "--x", "1", env=env, cwd=tmp_path).output)
    launch_env = {**{k: v for k, v in os.environ.items()}, **env}
    done = subprocess.run(
        [sys.executable, "-m", "accel.cli", "--nproc-per-node", "2", "--cpu", str(script),
         "--x", "1"], cwd=tmp_path, env={k: v for k, v in launch_env.items() if v is not None},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    launched = _records(done.stdout)
    assert len(forked) == len(launched) == 2
    for ours, theirs in zip(forked, launched, strict=True):
        ours_added, theirs_added = ours.pop("added"), theirs.pop("added")
        assert ours == theirs
        assert sorted(ours_added) == sorted(theirs_added)
        for key in sorted(set(theirs_added) - _PER_RUN):
            assert ours_added[key] == theirs_added[key], key


PRELOADING = '''
import sys
from accel.testing import preload, run_distributed

def loaded():
    return "xml.dom.minidom" in sys.modules

if __name__ == "__main__":
    preload("xml.dom.minidom")
    print(run_distributed(loaded, world_size=2))
    try:
        preload("csv")
    except Exception as error:
        print(type(error).__name__, error)
'''


@pytest.mark.slow  # the script starts a warm server of its own
@pytest.mark.ci_extra
def test_preload_adds_modules_to_the_warm_server_before_it_starts(tmp_path: Path) -> None:
    for missing in ("no_such_module_here", "no_such_package_here.sub"):
        with pytest.raises(ConfigError, match=missing):
            preload(missing)
    done = run_script(_write(tmp_path, PRELOADING), world_size=1, launch=False, timeout=240)
    first, second = done.output.splitlines()
    assert first == "[True, True]"  # imported by the server, before the fork
    assert second.startswith("ConfigError preload('csv',) comes after the warm server started")

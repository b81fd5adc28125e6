"""Workers never outlive their launcher: SIGKILL of `accel launch` (a scheduler's kill after
the grace period, the OOM killer) or of a notebook launcher's parent ends every worker
(Linux: a parent-death signal armed in the worker before user code)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accel.launch.parent_death import die_with_parent
from tests.cli._helpers import Launched, clean_env, write_script

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")

SLEEPER = """
import os, time
print(f"WORKER {os.getpid()}", flush=True)
time.sleep(300)
"""

NOTEBOOK = """
import os, time
import accel

def work():
    print(f"WORKER {os.getpid()}", flush=True)
    time.sleep(300)

if __name__ == "__main__":
    accel.notebook_launcher(work, num_processes=2)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie no init reaps in a container counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _workers(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"WORKER (\d+)", output)]


def _wait_until_ended(pids: list[int], bound: float = 30.0) -> list[int]:
    """The pids still running once they all ended or ``bound`` seconds passed (a bound on a
    hang, not a timing: the kernel kills them when the parent dies)."""
    deadline = time.monotonic() + bound
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.ci_extra  # a whole launch killed
def test_sigkill_of_accel_launch_ends_every_worker(tmp_path: Path) -> None:
    script = write_script(tmp_path, SLEEPER, "sleeper.py")
    launched = Launched(["--nproc-per-node", "2", str(script)], tmp_path)
    pids: list[int] = []
    try:
        launched.wait_for("WORKER ", count=2, timeout=120)
        pids = _workers(launched.output)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        os.kill(launched.proc.pid, signal.SIGKILL)
        launched.proc.wait(30)
        assert _wait_until_ended(pids) == [], "workers outlived their launcher"
    finally:
        _kill_all(pids)
        launched.kill()


@pytest.mark.slow
@pytest.mark.ci_extra  # a whole notebook launch killed
def test_sigkill_of_a_notebook_launchers_parent_ends_every_worker(tmp_path: Path) -> None:
    script = write_script(tmp_path, NOTEBOOK, "notebook.py")
    parent = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=clean_env(tmp_path), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        output = ""
        while len(_workers(output)) < 2:
            line = parent.stdout.readline()
            if not line:
                pytest.fail(f"the notebook launcher ended first:\n{output[-3000:]}")
            output += line
        pids = _workers(output)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        assert _wait_until_ended(pids) == [], "workers outlived the notebook launcher's parent"
    finally:
        _kill_all(pids)
        if parent.poll() is None:
            parent.kill()


def test_die_with_parent_arms_the_signal_or_watches() -> None:
    script = (
        "import os, signal, sys\n"
        "from accel.launch.parent_death import die_with_parent\n"
        "how = die_with_parent()\n"
        "print(how)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == (["prctl"] if sys.platform.startswith("linux") else ["watch"])
    assert callable(die_with_parent)

"""run_script/start_script end every process the run created, on every way a run ends (issue 34).

Each rank of the script below starts four processes that outlive it unless the harness ends
them: a plain ``subprocess.Popen`` child, one in a new session (``start_new_session=True``:
out of the rank's process group), a daemon whose parent (``sh``) exits at once, and a Python
``os.fork`` child in a new session, which inherits every descriptor of the rank (the fork
server's "alive" pipe among them: while it lives, the fork server, which holds the caller's
stdout, lives too). The rank writes their PIDs to ``pids.<rank>``; each test checks that they
are gone shortly after the run returns, and kills any survivor itself.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel.testing import run_distributed, run_script, start_script
from accel.testing._forkserver import _children, _children_by_stat

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="Linux: a child subreaper, /proc")

SCRIPT = '''
import os, subprocess, sys, time

rank = os.environ.get("RANK", "0")
mode = sys.argv[1]
plain = subprocess.Popen(["sleep", "30"])
session = subprocess.Popen(["sleep", "30"], start_new_session=True)
daemon = int(subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"],
                            capture_output=True, text=True, check=True).stdout)
forked = os.fork()
if forked == 0:  # a Python child in its own session: it has every descriptor of the rank
    os.setsid()
    time.sleep(30)
    os._exit(0)
with open(f"pids.{rank}.tmp", "w") as file:
    file.write(" ".join(str(pid) for pid in (plain.pid, session.pid, daemon, forked)))
os.replace(f"pids.{rank}.tmp", f"pids.{rank}")
print("started", flush=True)
if mode == "exception":
    raise RuntimeError("failed on purpose")
if mode == "os_exit":
    os._exit(7)
if mode == "hang":
    time.sleep(30)
'''

_GONE_WITHIN_S = 2.0


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _pids(tmp_path: Path) -> list[int]:
    return [int(pid) for path in sorted(tmp_path.glob("pids.[0-9]*"))
            if not path.name.endswith(".tmp") for pid in path.read_text().split()]


def _still_running(pids: list[int]) -> list[int]:
    """The PIDs still running after up to :data:`_GONE_WITHIN_S` seconds."""
    deadline = time.monotonic() + _GONE_WITHIN_S
    while True:
        left = [pid for pid in pids if _running(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


@pytest.fixture
def script(tmp_path: Path) -> Iterator[Path]:
    """The script, in ``tmp_path``; afterwards every grandchild it recorded is killed."""
    path = tmp_path / "spawner.py"
    path.write_text(SCRIPT)
    try:
        yield path
    finally:
        for pid in _pids(tmp_path):
            if _running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _assert_all_ended(tmp_path: Path, world_size: int) -> None:
    pids = _pids(tmp_path)
    assert len(pids) == 4 * world_size, f"the ranks recorded {pids}"
    assert _still_running(pids) == [], "processes the script started outlived the run"
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(("mode", "timeout", "codes"), [
    ("success", 60, (0, 0)),
    ("exception", 60, (1, 1)),
    ("os_exit", 60, (7, 7)),
    # waits out its timeout (2.5 s with the ranks' stack dumps)
    pytest.param("hang", 2, (-signal.SIGKILL, -signal.SIGKILL), marks=pytest.mark.slow),
])
def test_every_process_the_script_started_ends_with_the_run(
    script: Path, mode: str, timeout: float, codes: tuple[int, int],
) -> None:
    tmp_path = script.parent
    result = run_script(script, mode, world_size=2, cwd=tmp_path, timeout=timeout,
                        check=False)
    assert result.exit_codes == codes, result.stderr
    assert result.stdout == ("started\n", "started\n")
    assert result.timed_out == (mode == "hang")
    _assert_all_ended(tmp_path, 2)


def test_launch_false_ends_them_too(script: Path) -> None:
    tmp_path = script.parent
    result = run_script(script, "os_exit", world_size=1, launch=False, cwd=tmp_path,
                        check=False)
    assert result.exit_codes == (7,)
    _assert_all_ended(tmp_path, 1)


def test_a_signalled_rank_and_leaving_start_scripts_block_end_them(script: Path) -> None:
    tmp_path = script.parent
    with start_script(script, "hang", world_size=2, cwd=tmp_path, timeout=60) as run:
        run.wait_for("started", rank=0)
        run.wait_for("started", rank=1)
        run.send_signal(signal.SIGTERM)  # ends the ranks (SIGTERM's default action) only
        assert run.wait(check=False).exit_codes == (-signal.SIGTERM, -signal.SIGTERM)
    _assert_all_ended(tmp_path, 2)
    (tmp_path / "pids.0").unlink()
    (tmp_path / "pids.1").unlink()
    with start_script(script, "hang", world_size=2, cwd=tmp_path, timeout=60) as run:
        run.wait_for("started", rank=0)
        run.wait_for("started", rank=1)
    _assert_all_ended(tmp_path, 2)


def test_a_keyboard_interrupt_in_the_caller_ends_them(script: Path) -> None:
    tmp_path = script.parent
    main = threading.get_ident()
    assert main == threading.main_thread().ident
    done = threading.Event()

    def interrupt() -> None:  # Ctrl-C, once both ranks have started their processes
        deadline = time.monotonic() + 20
        while len(_pids(tmp_path)) < 8 and time.monotonic() < deadline:
            if done.wait(0.01):  # run_script ended first: no stray Ctrl-C
                return
        signal.pthread_kill(main, signal.SIGINT)

    thread = threading.Thread(target=interrupt)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_script(script, "hang", world_size=2, cwd=tmp_path, timeout=30)
    finally:
        done.set()
        thread.join()
    _assert_all_ended(tmp_path, 2)


DRIVER = '''
import sys
from accel.testing import run_script

if __name__ == "__main__":
    result = run_script(sys.argv[1], "success", world_size=2, cwd=sys.argv[2])
    print("exit codes", result.exit_codes, flush=True)
'''


@pytest.mark.slow
@pytest.mark.ci_extra
def test_the_callers_stdout_is_released_when_it_exits(script: Path) -> None:
    """`python driver.py | tail` ends: nothing the run started keeps the caller's stdout."""
    tmp_path = script.parent
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    # the pipe's reader gets end-of-file once every writer is gone: the driver, its fork
    # server and resource tracker, and anything that inherited one of them
    output = subprocess.run([sys.executable, str(driver), str(script), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=25, check=False)
    assert output.returncode == 0, output.stdout
    assert "exit codes (0, 0)" in output.stdout
    _assert_all_ended(tmp_path, 2)


def _start_a_session(pid_file: str) -> int:
    """A run_distributed body: a child in a new session, left running."""
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    Path(pid_file).write_text(str(child.pid))
    return child.pid


def test_run_distributed_ends_them_too(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids.0"
    try:
        [pid] = run_distributed(_start_a_session, str(pid_file), world_size=1)
        assert _still_running([pid]) == []
    finally:
        for pid in _pids(tmp_path):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


UNEVEN = '''
import os, subprocess, sys, time

if os.environ["RANK"] == "1":  # ends at once
    with open("rank1.pid", "w") as file:
        file.write(str(os.getpid()))
    sys.exit(0)
session = subprocess.Popen(["sleep", "30"], start_new_session=True)
daemon = int(subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"],
                            capture_output=True, text=True, check=True).stdout)
with open("pids.0.tmp", "w") as file:
    file.write(f"{session.pid} {daemon}")
os.replace("pids.0.tmp", "pids.0")
print("started", flush=True)
deadline = time.monotonic() + 10
while not os.path.exists("stop") and time.monotonic() < deadline:
    time.sleep(0.01)
'''


def test_what_a_running_rank_started_lives_while_it_runs(script: Path) -> None:
    """Another rank's end kills only what that rank left, not a running rank's processes."""
    tmp_path = script.parent
    script.write_text(UNEVEN)
    with start_script(script, world_size=2, cwd=tmp_path, timeout=30) as run:
        run.wait_for("started", rank=0)
        rank1 = tmp_path / "rank1.pid"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
                not rank1.exists() or os.path.exists(f"/proc/{rank1.read_text()}")):
            time.sleep(0.01)  # until rank 1 has ended and been reaped
        time.sleep(0.1)
        pids = _pids(tmp_path)
        assert [pid for pid in pids if _running(pid)] == pids  # rank 0's, rank 0 running
        (tmp_path / "stop").touch()
        assert run.wait().exit_codes == (0, 0)
    assert _still_running(pids) == []


def test_a_process_children_are_read_from_proc_with_or_without_the_children_file() -> None:
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        found = _children(os.getpid())
        assert {child.pid for child in children} <= set(found)
        assert sorted(_children_by_stat(os.getpid())) == sorted(found)
    finally:
        for child in children:
            child.kill()
            child.wait()

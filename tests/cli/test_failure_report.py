"""The launcher's failure report: a multi-line exception message kept whole (bounded), and a
signal death described plainly, "out of memory" only with the kernel's evidence.

The report is built from torch elastic's failure records (no workers started) except in the
`slow` tests at the end, which launch one worker that raises, aborts or is killed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from accel.launch.failures import describe_failure
from accel.launch.oom import OomCount, oom_evidence, read_oom_kills
from tests.cli._helpers import accel_command, clean_env, run_bounded

FIVE_LINES = ("ValueError: microbatch shapes differ across the dp group:\n"
              "  rank 0: (4, 8)\n"
              "  rank 1: (2, 8)\n"
              "  rank 2: (4, 8)\n"
              "Give every rank the same batch size.")


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None,
             when: float) -> ProcessFailure:
    """A failure record as accel's worker writes it (``message``: the exception's text)."""
    error_file = tmp_path / f"error{rank}.json"
    if message is not None:
        trace = ('Traceback (most recent call last):\n  File "t.py", line 3, in check\n'
                 f"    raise error\n{message}\n")
        error_file.write_text(json.dumps({"message": {
            "message": message,
            "extraInfo": {"py_callstack": trace, "timestamp": str(int(when)),
                          "accel_time": repr(when)},
        }}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(error_file))


def _report(tmp_path: Path, failures: dict[int, Any], **kwargs: Any) -> tuple[str, int]:
    return describe_failure(ChildFailedError("t.py", failures), "t.py", **kwargs)


def test_a_multi_line_message_is_kept_whole_on_every_rank(tmp_path: Path) -> None:
    other = FIVE_LINES.replace("ValueError", "RuntimeError").replace("rank 1: (2", "rank 1: (3")
    text, code = _report(tmp_path, {
        1: _failure(tmp_path, 1, 1, FIVE_LINES, 100.1),  # the first failure
        0: _failure(tmp_path, 0, 1, other, 100.2),
    })
    assert code == 1
    lines = text.splitlines()
    first = next(line for line in lines if "failed on rank 1" in line)
    # the summary names the exception and its first line, not the message's last line
    assert first.endswith("(first failure)"), text
    assert "raised ValueError: microbatch shapes differ across the dp group:" in first, text
    assert "raised Give every rank" not in text
    block = text.split("----- traceback of rank 1 -----", 1)[1]
    assert FIVE_LINES in block  # whole, in order
    # the other rank has no traceback block: its message follows its summary line, indented
    second = lines.index(next(line for line in lines if "failed on rank 0" in line))
    assert "raised RuntimeError: microbatch shapes differ" in lines[second]
    assert lines[second + 1:second + 5] == ["    " + line for line in other.splitlines()[1:]]


def test_a_huge_message_is_bounded_with_a_marker(tmp_path: Path) -> None:
    many = "ValueError: bad\n" + "\n".join(f"line {i}" for i in range(1, 1000))
    text, _ = _report(tmp_path, {
        0: _failure(tmp_path, 0, 1, many, 100.1),
        1: _failure(tmp_path, 1, 1, many.replace("ValueError", "KeyError"), 100.2),
    })
    assert len(text) < 12_000, len(text)
    assert "line 1\n" in text and "line 999" not in text
    assert text.count("more lines)") == 2, text  # the traceback block and rank 1's message
    wide = "ValueError: " + "x" * 100_000
    text, _ = _report(tmp_path, {0: _failure(tmp_path, 0, 1, wide, 100.1)})
    assert len(text) < 6_000, len(text)
    assert "more characters)" in text
    # deep frames (a chain of exceptions, say): the innermost ones are kept, after a marker
    frames = "".join(f'  File "t.py", line {i}, in f{i}\n    g()\n' for i in range(5000))
    (tmp_path / "error0.json").write_text(json.dumps({"message": {
        "message": "ValueError: deep", "extraInfo": {
            "py_callstack": f"Traceback (most recent call last):\n{frames}ValueError: deep\n",
            "timestamp": "100", "accel_time": "100.0"}}}))
    deep = ProcessFailure(local_rank=0, pid=1000, exitcode=1,
                          error_file=str(tmp_path / "error0.json"))
    text, _ = _report(tmp_path, {0: deep})
    assert len(text) < 20_000, len(text)
    assert "earlier lines" in text and "in f4999\n" in text and "in f0\n" not in text
    assert text.rstrip("-\n").endswith("ValueError: deep")


def test_sigkill_without_oom_evidence_is_not_called_out_of_memory(tmp_path: Path) -> None:
    failures: dict[int, Any] = {1: _failure(tmp_path, 1, -9, None, 5.0)}
    unchanged = oom_evidence([OomCount("/sys/fs/cgroup/x/memory.events", "cgroup", 2)],
                             [OomCount("/sys/fs/cgroup/x/memory.events", "cgroup", 2)])
    for evidence in (None, unchanged):
        text, code = _report(tmp_path, failures, oom=evidence)
        assert code == 128 + 9
        assert "killed by signal SIGKILL" in text
        assert "no Python exception" in text
        assert "often means out of memory" not in text
        assert "ran out of memory" not in text
        assert "another process" in text.lower() and "`dmesg`" in text, text
    assert "/sys/fs/cgroup/x/memory.events" in _report(tmp_path, failures, oom=unchanged)[0]


def test_sigkill_with_an_oom_kill_recorded_says_out_of_memory(tmp_path: Path) -> None:
    failures: dict[int, Any] = {1: _failure(tmp_path, 1, -9, None, 5.0)}
    source = "/sys/fs/cgroup/memory/job/memory.oom_control"
    evidence = oom_evidence([OomCount(source, "cgroup", 0)], [OomCount(source, "cgroup", 1)])
    text, code = _report(tmp_path, failures, oom=evidence)
    assert code == 128 + 9
    assert "ran out of memory" in text, text
    assert source in text and "from 0 to 1" in text
    # an OOM kill elsewhere on the machine only makes it likely
    machine = oom_evidence([OomCount("/proc/vmstat", "machine", 4)],
                           [OomCount("/proc/vmstat", "machine", 5)])
    text, _ = _report(tmp_path, failures, oom=machine)
    assert "likely ran out of memory" in text and "/proc/vmstat" in text, text
    # an OOM kill does not explain another signal
    text, _ = _report(tmp_path, {1: _failure(tmp_path, 1, -6, None, 5.0)}, oom=evidence)
    assert "out of memory" not in text


def test_sigabrt_is_described_as_an_abort_not_memory(tmp_path: Path) -> None:
    text, code = _report(tmp_path, {0: _failure(tmp_path, 0, -6, None, 5.0)})
    assert code == 128 + 6
    assert "killed by signal SIGABRT" in text
    assert "aborted" in text and "C++" in text and "collective" in text, text
    assert "memory" not in text
    assert "PYTHONFAULTHANDLER=1" in text
    segv, _ = _report(tmp_path, {0: _failure(tmp_path, 0, -11, None, 5.0)})
    assert "segmentation fault" in segv and "memory" not in segv


def test_oom_counters_are_read_from_the_cgroup_and_the_machine(tmp_path: Path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/vmstat").write_text("nr_free_pages 5\noom_kill 7\n")
    (tmp_path / "proc/self/cgroup").write_text("4:memory:/job/a\n0::/job/b\n")
    v1 = tmp_path / "sys/fs/cgroup/memory/job/a"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    v2 = tmp_path / "sys/fs/cgroup/job/b"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    counts = read_oom_kills(tmp_path)
    assert {(c.source, c.scope, c.count) for c in counts} == {
        (str(v2 / "memory.events"), "cgroup", 2), (str(v1 / "memory.oom_control"), "cgroup", 3),
        (str(tmp_path / "proc/vmstat"), "machine", 7)}
    # the job's cgroup is the authority when it can be read: a kill elsewhere is no evidence
    after = [OomCount(c.source, c.scope, c.count + (c.scope == "machine")) for c in counts]
    found = oom_evidence(counts, after)
    assert found is not None and found.kills == 0 and found.scope == "cgroup"
    # unreadable or malformed files are skipped; nothing readable: no evidence either way
    (v2 / "memory.events").write_text("oom_kill lots\n")
    (v1 / "memory.oom_control").unlink()
    (tmp_path / "proc/vmstat").unlink()
    assert read_oom_kills(tmp_path) == ()
    assert oom_evidence((), ()) is None


SCRIPTS = {
    "multi.py": "def check():\n    raise ValueError(" + repr(FIVE_LINES.split(": ", 1)[1])
                + ")\ncheck()\n",
    "abort.py": "import os\nos.abort()\n",
    "kill.py": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
}


@pytest.mark.slow
@pytest.mark.ci_extra  # whole launches: ~2 s each
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_launched_worker_failure_is_reported(tmp_path: Path, script: str) -> None:
    # one worker, no torch imported in it: the launcher's report end to end in ~2 s
    (tmp_path / script).write_text(SCRIPTS[script])
    done = run_bounded(accel_command("launch", "--nproc-per-node", "1", "--cpu", script),
                       cwd=tmp_path, env=clean_env(tmp_path), timeout=45)
    out = done.stdout
    summary = [line for line in out.splitlines() if line.startswith("accel launch: ")]
    assert len(summary) == 1, out
    if script == "multi.py":
        assert done.returncode == 1, out
        assert "raised ValueError: microbatch shapes differ across the dp group:" in summary[0]
        assert FIVE_LINES in out.split("----- traceback of rank 0 -----", 1)[1], out
    elif script == "abort.py":
        assert done.returncode == 128 + 6, out
        assert "killed by signal SIGABRT" in summary[0], out
        assert "aborted" in out and "memory" not in out.split(summary[0], 1)[1], out
    else:  # killed by a process, not the OOM killer: the kernel counted no OOM kill
        assert done.returncode == 128 + 9, out
        assert "killed by signal SIGKILL" in summary[0], out
        assert "ran out of memory" not in out and "`dmesg`" in out, out

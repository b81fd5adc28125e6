"""Machine faults on namespaced machines (accel.testing.machines), each ending every surviving
machine's job within seconds with an accel error naming the lost machine: a machine's
processes SIGKILLed mid-training, its link cut mid all-reduce (both sides end, each naming
the other), a machine that never arrives at start-up (named within --rendezvous-timeout), a
machine killed in the middle of ``save_state`` (the previous checkpoint stays the latest on
every machine, and the job resumes from it), and a slow machine (sleep, GIL-holding loop,
long write: 3 x the liveness timeout) never declared lost. The seconds
each took are printed; the tests bound them only by generous waits.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import accel
from accel.testing.machines import Machines, requires_machines
from tests.cli._helpers import clean_env

pytestmark = [pytest.mark.ci_extra, pytest.mark.slow, requires_machines()]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("fault_script.py"))
LIVENESS = "4"  # seconds: the tests' liveness timeout (default 10)


def _env(tmp_path: Path) -> dict[str, str]:
    return clean_env(tmp_path, PYTHONPATH=str(ROOT), ACCEL_LIVENESS_TIMEOUT=LIVENESS)


def _training(marks: Path, ranks: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(marks.glob("*.step"))) < ranks:
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.1)


def _start(bed: Machines, tmp_path: Path, mode: str, nproc: int = 1) -> tuple[list, Path]:
    marks = tmp_path / f"marks-{mode}"
    marks.mkdir()
    runs = bed.accel_launch([SCRIPT, mode, str(marks)], nproc_per_node=nproc,
                            env=_env(tmp_path), cwd=tmp_path)
    return runs, marks


def _kill_machine_1(bed: Machines, runs: list, ranks: str, what: str) -> None:
    """SIGKILL machine 1; machine 0's job must end naming it (hostname, node rank, ``ranks``)."""
    start = time.monotonic()
    bed.kill(1)
    code = runs[0].wait(timeout=60)
    print(f"machine 0 ended {time.monotonic() - start:.1f}s after machine 1 {what}")
    out = runs[0].output
    assert code != 0, out
    assert "MachineLostError" in out, out
    assert f"machine {bed.hostname(1)!r} (node rank 1, ranks {ranks})" in out, out


def test_a_killed_machine_is_named_on_the_survivor(tmp_path: Path) -> None:
    with Machines(2, shared=tmp_path) as bed:
        runs, marks = _start(bed, tmp_path, "train", nproc=2)
        _training(marks, 4)
        _kill_machine_1(bed, runs, "[2, 3]", "was killed")


def test_b_a_cut_link_ends_both_sides_each_naming_the_other(tmp_path: Path) -> None:
    with Machines(2, shared=tmp_path) as bed:
        runs, marks = _start(bed, tmp_path, "train")
        _training(marks, 2)
        start = time.monotonic()
        bed.cut(1)
        codes = [run.wait(timeout=60) for run in runs]
        print(f"both ended {time.monotonic() - start:.1f}s after the cut (liveness {LIVENESS}s)")
        assert codes[0] != 0 and codes[1] != 0
        zero, one = runs[0].output, runs[1].output
        assert f"Lost machine {bed.hostname(1)!r} (node rank 1, ranks [1])" in zero, zero
        assert f"Lost machine {bed.hostname(0)!r} (node rank 0, ranks [0])" in one, one
        assert "which holds the job's store" in one, one
        bed.restore(1)


def test_c_a_machine_that_never_arrives_is_named(tmp_path: Path) -> None:
    with Machines(2, shared=tmp_path) as bed:
        marks = tmp_path / "marks"
        marks.mkdir()
        [run] = bed.accel_launch([SCRIPT, "train", str(marks)], nproc_per_node=1,
                                 options=["--rendezvous-timeout", "5"], machines=[0],
                                 env=_env(tmp_path), cwd=tmp_path)
        start = time.monotonic()
        code = run.wait(timeout=90)
        print(f"machine 0 ended {time.monotonic() - start:.1f}s after its start")
        assert code == 1, run.output
        assert "never arrived within rendezvous_timeout=5s: node rank 1" in run.output, run.output
        assert f"host {bed.hostname(0)!r}" in run.output
        [alone] = bed.accel_launch([SCRIPT, "train", str(marks)], nproc_per_node=1,
                                   options=["--rendezvous-timeout", "5"], machines=[1],
                                   env=_env(tmp_path), cwd=tmp_path)
        assert alone.wait(timeout=90) == 1, alone.output
        assert "could not be reached from node rank 1" in alone.output, alone.output


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_d_a_machine_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path,
                                                                    kind: str) -> None:
    with Machines(2, shared=tmp_path) as bed:
        marks = tmp_path / "marks"
        marks.mkdir()
        args = [f"save-{kind}", str(marks), str(bed.disk_path)]
        runs = bed.accel_launch([SCRIPT, *args], env=_env(tmp_path), cwd=tmp_path)
        deadline = time.monotonic() + 90
        while not (marks / "saving").exists():  # machine 1 is writing checkpoint_6's files
            assert time.monotonic() < deadline, [run.output for run in runs]
            time.sleep(0.1)
        _kill_machine_1(bed, runs, "[1]", "died mid-save")
        roots = [bed.disk(k) / "ckpt" for k in range(2)] if kind == "local" else [marks / "ckpt"]
        unfinished = [p for root in roots for p in root.iterdir() if p.name.startswith(".")
                      and p.is_dir()]  # the dead save's hidden directories, never renamed
        assert len(unfinished) == len(roots), unfinished
        for root in roots:  # each machine's copy (local) or the one copy (shared)
            assert [p.name for p in sorted(root.iterdir()) if not p.name.startswith(".")] == [
                "checkpoint_3"], sorted(root.iterdir())
            assert accel.latest_checkpoint(root) == root / "checkpoint_3"
        resumed = bed.accel_launch([SCRIPT, f"resume-{kind}", *args[1:]], env=_env(tmp_path),
                                   cwd=tmp_path)
        codes = [run.wait(timeout=90) for run in resumed]
        outputs = [run.output for run in resumed]
        assert codes == [0, 0], outputs
        for rank, output in enumerate(outputs):
            assert f"rank {rank} resumed from " in output and "checkpoint_3 step 3" in output, (
                output)
        for root in roots:  # the resumed job's save removed the dead save's leftovers
            assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
                "checkpoint_3", "checkpoint_7"], sorted(root.iterdir())


def test_a_slow_machine_is_not_lost(tmp_path: Path) -> None:
    with Machines(2, shared=tmp_path) as bed:
        runs, _ = _start(bed, tmp_path, "slow")
        codes = [run.wait(timeout=180) for run in runs]
        outputs = [run.output for run in runs]
        assert codes == [0, 0], outputs
        assert "MachineLostError" not in "".join(outputs)
        assert "pauses" in outputs[1] and "done" in outputs[0]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-x", "-q", "-s"]))

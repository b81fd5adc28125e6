"""examples/pipeline_parallel.py: 2 pipeline stages on 2 CPU processes print the losses one
process prints, with two schedules; the checkpoint resumes on one process. A smoke run of
bench/parallel.py's pipeline rows."""

from __future__ import annotations

import json
import pathlib

import pytest

from accel.testing import run_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pipeline_parallel.py"


def _steps(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


def test_two_stages_print_the_losses_of_one_process(tmp_path: pathlib.Path) -> None:
    one = run_script(EXAMPLE, "--steps", "3", world_size=1, launch=False, timeout=120)
    want = _steps(one.output)
    assert len(want) == 3 and "pp stages: 1" in one.output
    for schedule in ("1F1B", "ZBVZeroBubble"):
        run = run_script(EXAMPLE, "--steps", "3", "--schedule", schedule, "--save-dir",
                         str(tmp_path / schedule), world_size=2, env={"ACCEL_PP_SIZE": "2"},
                         timeout=120)
        assert "pp stages: 2, this rank: 0" in run.stdout[0]
        assert [s[:-1] for s in _steps(run.stdout[0])] == [s[:-1] for s in want], schedule
    resumed = run_script(EXAMPLE, "--steps", "1", "--resume", str(tmp_path / "1F1B"),
                         world_size=1, launch=False, timeout=120)
    first = _steps(resumed.output)
    assert len(first) == 1 and first[0] != want[0]  # trained weights: another loss


@pytest.mark.ci_extra
@pytest.mark.slow
def test_pipeline_bench_smoke_run() -> None:
    # `python bench/parallel.py --pp 2 ...` with tiny sizes (raises if it fails)
    bench = EXAMPLE.parents[1] / "bench" / "parallel.py"
    done = run_script(bench, "--procs", "2", "--pp", "2", "--width", "16", "--blocks", "2",
                      "--windows", "2", "--steps", "2", "--schedules", "1F1B", "GPipe",
                      world_size=1, launch=False, timeout=300, env={"OMP_NUM_THREADS": "1"})
    report = json.loads(done.output[done.output.index("{"):])
    assert report["pp"] == 2 and list(report["schedules"]) == ["1F1B", "GPipe"]
    for row in report["schedules"].values():
        assert row["raw_us"] > 0 and row["accel_us"] > 0 and isinstance(row["overhead_pct"], float)
        assert row["loss_diff"] < 1e-6  # the two loops train the same weights
        assert len(row["glue_overhead_us"]) == 2 and len(row["cprofile_own_us"]) == 2
        assert all(len(rank["forward_backward"]) == 3 for rank in row["stage_us"])

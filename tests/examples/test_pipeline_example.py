"""examples/pipeline_parallel.py: 2 pipeline stages on 2 CPU processes print the losses one
process prints, with two schedules; the checkpoint resumes on one process."""

from __future__ import annotations

import pathlib

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

"""examples/tensor_parallel.py: the same losses on one process, TP2 x FSDP2 and TP4 (4 CPU
processes, sizes given as `accel launch --tp-size/--dp-shard-size` gives them: ACCEL_*
variables), and its TP2 x FSDP2 checkpoint resumes on one process."""

from __future__ import annotations

import pathlib

import pytest

from accel.testing import run_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tensor_parallel.py"


def _steps(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow
@pytest.mark.ci_extra
def test_every_mesh_prints_the_losses_of_one_process(tmp_path: pathlib.Path) -> None:
    one = run_script(EXAMPLE, "--steps", "3", world_size=1, launch=False, timeout=240)
    want = _steps(one.output)
    assert len(want) == 3 and "mesh (pp, dp_replicate, dp_shard, cp, tp) = None" in one.output
    for sizes, shape in (({"ACCEL_TP_SIZE": "2", "ACCEL_DP_SHARD_SIZE": "2"}, "(1, 1, 2, 1, 2)"),
                         ({"ACCEL_TP_SIZE": "4"}, "(1, 1, 1, 1, 4)")):
        run = run_script(EXAMPLE, "--steps", "3", "--save-dir", str(tmp_path / "ckpt"),
                         world_size=4, env=sizes, timeout=240)
        assert f"mesh (pp, dp_replicate, dp_shard, cp, tp) = {shape}, 4 processes" in run.stdout[0]
        assert _steps(run.stdout[0]) == want, sizes  # printed by rank 0 (losses: world means)
        assert all(not _steps(out) for out in run.stdout[1:])
    resumed = run_script(EXAMPLE, "--steps", "1", "--resume", str(tmp_path / "ckpt"),
                         world_size=1, launch=False, timeout=240)
    first = _steps(resumed.output)
    assert len(first) == 1 and first[0] != want[0]  # trained weights: a lower loss
    assert float(first[0].split()[3]) < float(want[-1].split()[3])

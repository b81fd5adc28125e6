"""Every example runs on 2 CPU processes (as the README tells users to run them)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# example -> (extra arguments for a short run, text its output must contain)
CASES = {
    "quicktour.py": (["--epochs", "2", "--data-len", "2000"], "training finished"),
    "accumulate.py": (["--epochs", "1"], ""),
    "mixed_precision.py": (["--epochs", "1"], ""),
    "checkpointing.py": (["--epochs", "1", "--output-dir", "{tmp}/ck"], "latest:"),
    "resume.py": (["--total-steps", "12", "--output-dir", "{tmp}/resume"], "finished at step 12"),
    "tracking.py": (["--epochs", "1", "--project-dir", "{tmp}/runs"], ""),
}


def _run(cmd: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_example_on_two_cpu_processes(name: str, tmp_path: pathlib.Path) -> None:
    args, expected = CASES[name]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = _run([sys.executable, "-m", "accel.launch", "--nproc-per-node", "2", "--cpu",
                 str(EXAMPLES / name), *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert expected in proc.stdout


@pytest.mark.slow
def test_resume_example_continues_where_it_stopped(tmp_path: pathlib.Path) -> None:
    base = [sys.executable, "-m", "accel.launch", "--nproc-per-node", "2", "--cpu",
            str(EXAMPLES / "resume.py"), "--output-dir", str(tmp_path / "r")]
    first = _run([*base, "--total-steps", "10"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run([*base, "--total-steps", "20"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "starting at step 10" in second.stdout and "finished at step 20" in second.stdout


@pytest.mark.slow
def test_notebook_launcher_example_from_plain_python(tmp_path: pathlib.Path) -> None:
    proc = _run([sys.executable, str(EXAMPLES / "notebook_launcher.py"), "--epochs", "1"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

"""Every example runs on 2 CPU processes (as the README tells users to run them)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# example -> (extra arguments for a short run, a regular expression its output must match
# exactly once: accel.print prints once per machine, not once per process)
CASES = {
    "quicktour.py": (["--epochs", "2", "--data-len", "2000"], r"training finished"),
    # 512 samples in batches of 16 on 2 processes: 16 batches each, a step every 4
    "accumulate.py": (["--epochs", "1"],
                      r"epoch 0: accuracy (?:0\.\d{3}|1\.000), 4 optimizer steps, lr \d\.\d{4}"),
    # bf16 (the example's default) uses no loss scaler: no step is ever skipped
    "mixed_precision.py": (["--epochs", "1"],
                           r"epoch 0 \(bf16\): accuracy (?:0\.\d{3}|1\.000), 0 skipped steps"),
    "checkpointing.py": (["--epochs", "1", "--output-dir", "{tmp}/ck"], r"latest: \S+"),
    "resume.py": (["--total-steps", "12", "--output-dir", "{tmp}/resume"],
                  r"finished at step 12\b"),
    "tracking.py": (["--epochs", "1", "--project-dir", "{tmp}/runs"],
                    r"logged to {tmp}/runs/\S+ with jsonl"),
    "preemptible.py": (["--total-steps", "12", "--output-dir", "{tmp}/pre"],
                       r"finished at step 12\b"),
}


def _run(cmd: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_example_on_two_cpu_processes(name: str, tmp_path: pathlib.Path) -> None:
    args, pattern = CASES[name]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = _run([sys.executable, "-m", "accel.launch", "--nproc-per-node", "2", "--cpu",
                 str(EXAMPLES / name), *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = re.findall(pattern.replace("{tmp}", re.escape(str(tmp_path))), proc.stdout)
    assert len(found) == 1, (pattern, proc.stdout[-2000:])
    if name == "tracking.py":  # the run directory holds the logged rows
        files = sorted((tmp_path / "runs").glob("*/metrics.jsonl"))
        assert len(files) == 1, files
        rows = [json.loads(line) for line in files[0].read_text().splitlines()]
        assert any("train/loss" in row for row in rows)
        evals = [row for row in rows if "eval/epoch" in row]  # nested keys joined with "/"
        assert [row["eval/epoch"] for row in evals] == [0]
        printed = re.findall(r"epoch 0: accuracy (\d\.\d{3})", proc.stdout)
        assert printed == [f"{evals[0]['eval/accuracy']:.3f}"]
    if name == "checkpointing.py":  # the printed checkpoint is a complete one
        latest = pathlib.Path(found[0].split(": ", 1)[1])
        assert latest.is_dir() and latest.parent == tmp_path / "ck"
    if name == "preemptible.py":  # not stopped: it ran to the end and saved the weights
        assert (tmp_path / "pre" / "final" / "model.safetensors").is_file()


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
    proc = _run([sys.executable, str(EXAMPLES / "notebook_launcher.py"), "--epochs", "1",
                 "--num-processes", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(re.findall(r"epoch 0: accuracy (?:0\.\d{3}|1\.000)", proc.stdout)) == 1
    final = re.findall(r"final accuracy on 2 processes: (0\.\d{3}|1\.000)", proc.stdout)
    assert len(final) == 1, proc.stdout[-2000:]

"""Every example runs on 2 CPU processes (as the README tells users to run them)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from accel.testing import ScriptResult, run_script

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


def _run(name: str, *args: str, cwd: pathlib.Path, launch: bool = True) -> ScriptResult:
    """The example as ``accel launch --nproc-per-node 2 --cpu examples/NAME ARGS`` runs it
    (``launch=False``: as ``python examples/NAME ARGS``), forked from warm workers by
    ``run_script``, which raises if a process exits non-zero."""
    return run_script(EXAMPLES / name, *args, world_size=2 if launch else 1, cwd=cwd,
                      env={"OMP_NUM_THREADS": "1"}, launch=launch)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_on_two_cpu_processes(name: str, tmp_path: pathlib.Path) -> None:
    args, pattern = CASES[name]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = _run(name, *args, cwd=tmp_path)
    assert done.exit_codes == (0, 0)
    stdout = done.output  # both processes' output (accel launch prints them interleaved)
    found = re.findall(pattern.replace("{tmp}", re.escape(str(tmp_path))), stdout)
    assert len(found) == 1, (pattern, stdout[-2000:])
    if name == "tracking.py":  # the run directory holds the logged rows
        files = sorted((tmp_path / "runs").glob("*/metrics.jsonl"))
        assert len(files) == 1, files
        rows = [json.loads(line) for line in files[0].read_text().splitlines()]
        assert any("train/loss" in row for row in rows)
        evals = [row for row in rows if "eval/epoch" in row]  # nested keys joined with "/"
        assert [row["eval/epoch"] for row in evals] == [0]
        printed = re.findall(r"epoch 0: accuracy (\d\.\d{3})", stdout)
        assert printed == [f"{evals[0]['eval/accuracy']:.3f}"]
    if name == "checkpointing.py":  # the printed checkpoint is a complete one
        latest = pathlib.Path(found[0].split(": ", 1)[1])
        assert latest.is_dir() and latest.parent == tmp_path / "ck"
    if name == "preemptible.py":  # not stopped: it ran to the end and saved the weights
        assert (tmp_path / "pre" / "final" / "model.safetensors").is_file()


def test_resume_example_continues_where_it_stopped(tmp_path: pathlib.Path) -> None:
    out = ["--output-dir", str(tmp_path / "r")]
    first = _run("resume.py", *out, "--total-steps", "10", cwd=tmp_path)
    assert first.exit_codes == (0, 0)
    second = _run("resume.py", *out, "--total-steps", "20", cwd=tmp_path)
    assert second.exit_codes == (0, 0)
    assert "starting at step 10" in second.output and "finished at step 20" in second.output


@pytest.mark.slow  # notebook_launcher starts torch's elastic agent and forks 2 workers
@pytest.mark.ci_extra
def test_notebook_launcher_example_from_plain_python(tmp_path: pathlib.Path) -> None:
    # the launcher's own end-to-end test (a fresh interpreter) is in tests/cli/test_notebook.py
    done = _run("notebook_launcher.py", "--epochs", "1", "--num-processes", "2", cwd=tmp_path,
                launch=False)
    assert done.exit_codes == (0,)
    assert len(re.findall(r"epoch 0: accuracy (?:0\.\d{3}|1\.000)", done.output)) == 1
    final = re.findall(r"final accuracy on 2 processes: (0\.\d{3}|1\.000)", done.output)
    assert len(final) == 1, done.output[-2000:]

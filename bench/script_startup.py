"""Time to an example's first training step: `accel launch` vs `accel.testing.run_script`; JSON.

``examples/preemptible.py`` (2 CPU processes, DDP, AdamW; rank 0 prints ``step 1`` once the
first optimizer step is done on both ranks) is started, in alternation so that machine drift
hits every kind alike, by:

- ``launch``: ``python -m accel.cli --nproc-per-node 2 --cpu examples/preemptible.py``, the
  time counted from just before the command starts to the ``step 1`` line on its stdout;
- ``warm``: ``accel.testing.start_script`` in this process, its warm server already running
  (what every test after the first one in a session gets), from the call to the line;
- ``cold``: the same in a fresh ``python`` whose first call starts the server (what the first
  test of a session gets), from that call to the line; the interpreter's own start and
  ``import accel.testing`` are not counted (pytest has paid them).

Reports each kind's median and the ratios launch/warm and launch/cold (goal: >= 5 to the
first step). The machine may be shared: compare the ratios, measured side by side.

Usage: python bench/script_startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "preemptible.py"
ARGS = ["--total-steps", "3"]
FIRST = "step 1\n"

COLD = f"""
import sys, time
from accel.testing import start_script
if __name__ == "__main__":
    start = time.monotonic()
    with start_script({str(EXAMPLE)!r}, *{ARGS!r}, "--output-dir", sys.argv[1], world_size=2,
                      env={{"OMP_NUM_THREADS": "1"}}) as run:
        run.wait_for({FIRST!r})
        first = time.monotonic() - start
        run.wait()
    print(first)
"""


def _launch(out: str, env: dict[str, str]) -> float:
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "accel.cli", "--nproc-per-node", "2", "--cpu", str(EXAMPLE),
         *ARGS, "--output-dir", out], env=env, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    first = None
    for line in proc.stdout:
        if first is None and line == FIRST:
            first = time.monotonic() - start
    if proc.wait() != 0 or first is None:
        raise RuntimeError(f"accel launch failed (exit code {proc.returncode})")
    return first


def _warm(out: str) -> float:
    from accel.testing import start_script

    start = time.monotonic()
    with start_script(EXAMPLE, *ARGS, "--output-dir", out, world_size=2,
                      env={"OMP_NUM_THREADS": "1"}) as run:
        run.wait_for(FIRST)
        first = time.monotonic() - start
        run.wait()
    return first


def _cold(out: str, env: dict[str, str], script: str) -> float:
    done = subprocess.run([sys.executable, script, out], env=env, text=True,
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"cold run failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {"launch": [], "warm": [], "cold": []}
    with tempfile.TemporaryDirectory(prefix="accel-startup-") as tmp:
        cold_script = os.path.join(tmp, "cold.py")
        Path(cold_script).write_text(COLD)
        _warm(os.path.join(tmp, "warm-up"))  # starts this process's server
        for run in range(args.runs):
            out = os.path.join(tmp, str(run))
            times["launch"].append(_launch(out + "-launch", env))
            times["warm"].append(_warm(out + "-warm"))
            times["cold"].append(_cold(out + "-cold", env, cold_script))
    median = {kind: statistics.median(values) for kind, values in times.items()}
    print(json.dumps({
        "example": "examples/preemptible.py --total-steps 3 on 2 CPU processes",
        "runs": args.runs,
        "seconds_to_first_step": {k: [round(v, 3) for v in values] for k, values in times.items()},
        "median_s": {k: round(v, 3) for k, v in median.items()},
        "ratio_launch_over_warm": round(median["launch"] / median["warm"], 1),
        "ratio_launch_over_cold": round(median["launch"] / median["cold"], 1),
        "goal": ">= 5x faster to the first step",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }, indent=2))


if __name__ == "__main__":
    main()

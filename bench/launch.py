"""Wall time from command start to the first training step: `accel launch` vs `torchrun`; JSON.

The same script (2 CPU processes by default, gloo, a tiny model) is started alternately by
``python -m accel.cli --nproc-per-node N`` and ``python -m torch.distributed.run
--standalone --nproc-per-node N`` (so machine drift hits both). Each worker prints the wall
clock when its first optimizer step is done; the time counted is from just before the command
starts to the latest rank's first step. Reports medians; the goal is
``accel - torchrun <= 0.3 s``. Also reported: the time from the start to the command's exit
(the workers' teardown and the launcher's own).

Usage: python bench/launch.py [--runs 7] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import sys
import time
import torch
import accel

with accel.distributed():
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    sys.stdout.write(f"FIRST_STEP {time.time()!r}\\n")  # one write: ranks share the pipe
    sys.stdout.flush()
"""


def _command(kind: str, nproc: int, script: str) -> list[str]:
    if kind == "accel":
        return [sys.executable, "-m", "accel.cli", "--nproc-per-node", str(nproc), script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), script]


def _time(kind: str, nproc: int, script: str, env: dict[str, str]) -> tuple[float, float, bool]:
    """Seconds to the last rank's first step and to the command's exit, and whether the job
    then exited with an error."""
    start = time.time()
    done = subprocess.run(_command(kind, nproc, script), env=env, text=True,
                          capture_output=True, check=False)
    ended = time.time() - start
    stamps = [float(value) for value in re.findall(r"FIRST_STEP ([0-9.]+)", done.stdout)]
    if len(stamps) != nproc:
        raise RuntimeError(f"{kind} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    # every rank reached its first step: the timing stands even if the exit then failed
    return max(stamps) - start, ended, done.returncode != 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    # both launchers get the same thread count and no accel config file
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as folder:
        env["XDG_CONFIG_HOME"] = folder
        env.pop("ACCEL_CONFIG_FILE", None)
        script = str(Path(folder) / "first_step.py")
        Path(script).write_text(SCRIPT)
        for kind in ("accel", "torchrun"):  # warm the file cache
            _time(kind, args.nproc, script, env)
        times: dict[str, list[float]] = {"accel": [], "torchrun": []}
        exits: dict[str, list[float]] = {"accel": [], "torchrun": []}
        failed_exits = {"accel": 0, "torchrun": 0}
        for _ in range(args.runs):
            for kind in times:
                seconds, ended, failed = _time(kind, args.nproc, script, env)
                times[kind].append(seconds)
                exits[kind].append(ended)
                failed_exits[kind] += failed
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    to_exit = {kind: statistics.median(values) for kind, values in exits.items()}
    print(json.dumps({
        "nproc": args.nproc,
        "runs": args.runs,
        "accel_s": round(medians["accel"], 3),
        "torchrun_s": round(medians["torchrun"], 3),
        "overhead_s": round(medians["accel"] - medians["torchrun"], 3),
        "goal_overhead_s": 0.3,
        "to_exit_s": {kind: round(value, 3) for kind, value in to_exit.items()},
        "to_exit_overhead_s": round(to_exit["accel"] - to_exit["torchrun"], 3),
        "failed_exits_after_first_step": failed_exits,
        "all_s": {kind: [round(v, 3) for v in values] for kind, values in times.items()},
    }, indent=2))


if __name__ == "__main__":
    main()

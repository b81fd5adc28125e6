"""Time `import accel` against `import torch` in fresh interpreters; print JSON.

Runs each command alternately (so machine drift hits both) and reports medians:
- ``accel``: ``python -c "import accel"`` (lazy: torch is not imported yet),
- ``accel_first_use``: ``import accel; accel.state()`` (loads torch and accel's core),
- ``torch``: ``python -c "import torch"``.
The headline ``ratio`` is accel / torch (goal <= 1.02); ``first_use_ratio`` shows what a
script that uses accel pays over torch alone.

Usage: python bench/import_time.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "accel": "import accel",
    "accel_first_use": "import accel; accel.state()",
    "torch": "import torch",
}


def _time(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    for code in COMMANDS.values():  # warm the file cache
        _time(code)
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, code in COMMANDS.items():
            samples[name].append(_time(code))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    leaked = subprocess.run(
        [sys.executable, "-c",
         "import sys, accel; print(sorted(m for m in ('torch', 'numpy', 'tqdm', 'tensorboard',"
         " 'wandb', 'mlflow', 'yaml') if m in sys.modules))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    print(json.dumps({
        "runs": args.runs,
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "ratio": round(medians["accel"] / medians["torch"], 4),
        "first_use_ratio": round(medians["accel_first_use"] / medians["torch"], 4),
        "heavy_modules_after_import_accel": json.loads(leaked.replace("'", '"')),
        "python": sys.version.split()[0],
    }, indent=2))


if __name__ == "__main__":
    main()

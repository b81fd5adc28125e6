"""distributed() under a real torchrun launch: env:// rendezvous, group created and destroyed."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.ci_extra  # a whole launch: ~5-8 s
def test_distributed_under_torchrun() -> None:
    script = pathlib.Path(__file__).with_name("torchrun_script.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("{"))
    info = json.loads(line)
    assert info == {"world": 2, "created": True, "total": 3.0, "gathered": [0, 1],
                    "backend": "gloo", "local_world": 2}
    assert proc.stdout.count("INITIALISED_AFTER=False") == 2

"""A run killed mid-training and restarted ends with bit-identical weights (1 and 2 ranks)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import safetensors.torch
import torch

SCRIPT = pathlib.Path(__file__).with_name("resume_script.py")
TOTAL = 26  # 44 samples / batch 4: several epochs, so resumes cross epoch boundaries


def _run(procs: int, root: pathlib.Path, die_at: int, out: pathlib.Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if procs == 1:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={procs}", str(SCRIPT)]
    proc = subprocess.run([*cmd, str(root), str(TOTAL), str(die_at), str(out)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    if die_at == 0:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_killed_and_resumed_run_matches_uninterrupted(procs: int, tmp_path: pathlib.Path) -> None:
    _run(procs, tmp_path / "straight", 0, tmp_path / "straight.safetensors")
    code = _run(procs, tmp_path / "resumed", 17, tmp_path / "unused.safetensors")
    assert code != 0  # it really died (after its step-15 checkpoint, mid accumulation cycle)
    assert not (tmp_path / "unused.safetensors").exists()
    _run(procs, tmp_path / "resumed", 0, tmp_path / "resumed.safetensors")
    straight = safetensors.torch.load_file(str(tmp_path / "straight.safetensors"))
    resumed = safetensors.torch.load_file(str(tmp_path / "resumed.safetensors"))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key

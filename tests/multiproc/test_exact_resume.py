"""A run killed mid-training and restarted ends with bit-identical weights (1 and 2 ranks)."""

from __future__ import annotations

import pathlib

import pytest
import safetensors.torch
import torch

from accel.testing import run_script

SCRIPT = pathlib.Path(__file__).with_name("resume_script.py")
TOTAL = 26  # 44 samples / batch 4: several epochs, so resumes cross epoch boundaries


def _run(procs: int, root: pathlib.Path, die_at: int, out: pathlib.Path) -> bool:
    """The script as `python` (1 process) or a launcher (2) runs it, forked from warm workers;
    whether every process exited 0 (required when it is not to die)."""
    done = run_script(SCRIPT, str(root), str(TOTAL), str(die_at), str(out), world_size=procs,
                      launch=procs > 1, env={"OMP_NUM_THREADS": "1"}, check=die_at == 0)
    return done.ok


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_killed_and_resumed_run_matches_uninterrupted(procs: int, tmp_path: pathlib.Path) -> None:
    _run(procs, tmp_path / "straight", 0, tmp_path / "straight.safetensors")
    ok = _run(procs, tmp_path / "resumed", 17, tmp_path / "unused.safetensors")
    assert not ok  # it really died (after its step-15 checkpoint, mid accumulation cycle)
    assert not (tmp_path / "unused.safetensors").exists()
    _run(procs, tmp_path / "resumed", 0, tmp_path / "resumed.safetensors")
    straight = safetensors.torch.load_file(str(tmp_path / "straight.safetensors"))
    resumed = safetensors.torch.load_file(str(tmp_path / "resumed.safetensors"))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key

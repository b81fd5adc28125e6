"""examples/fsdp.py: trained and saved on 2 CPU processes, resumed on 3, checked on 1.

The 2-process run saves a sharded checkpoint and the full weights (``save_model``) at step 6;
the 3-process run loads the checkpoint and trains steps 7 and 8. Here, in one plain process:

- the full weights load into a plain ``TinyLM`` and give the evaluation loss the 2-process
  run printed after saving;
- the 3-process run's first loss (step 7, before its update) is that plain model's loss on
  the next three batches (the loader continued where the 2 processes stopped);
- the checkpoint's model and AdamW state, loaded here into a plain model and optimizer on one
  process, take the step the 3 processes took (clipping included): the loss on the batches
  of step 8 equals the one the 3-process run printed.

Also a smoke run of bench/fsdp.py with tiny sizes (its JSON holds every figure; it removes its
checkpoints).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
from types import ModuleType

import pytest
import torch

import accel
from accel.testing import run_script

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "fsdp.py"
BATCH = 4  # the example's default --batch-size (per process)


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fsdp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(nproc: int, *args: str, cwd: pathlib.Path) -> str:
    """The example as ``accel launch --nproc-per-node NPROC --cpu`` runs it, forked from warm
    workers by ``run_script`` (raises if a rank fails); every rank's stdout in rank order."""
    return run_script(EXAMPLE, *args, world_size=nproc, cwd=cwd,
                      env={"OMP_NUM_THREADS": "1"}).output


def _losses(stdout: str) -> dict[int, float]:
    found = re.findall(r"^step (\d+) loss (\d+\.\d+)$", stdout, flags=re.MULTILINE)
    return {int(step): float(loss) for step, loss in found}


def _eval_loss(stdout: str, step: int) -> float:
    found = re.findall(rf"^eval loss (\d+\.\d+) at step {step}$", stdout, flags=re.MULTILINE)
    assert len(found) == 1, stdout[-2000:]
    return float(found[0])


@pytest.mark.slow
@pytest.mark.ci_extra
def test_fsdp_example_saves_on_two_and_resumes_on_three(tmp_path: pathlib.Path) -> None:
    ex = _example()
    out = tmp_path / "run"
    first = _launch(2, "--output-dir", str(out), "--steps", "6", "--save-at", "6", cwd=tmp_path)
    assert sorted(_losses(first)) == [1, 2, 3, 4, 5, 6], first[-2000:]  # printed once each
    saved_eval = _eval_loss(first, 6)
    second = _launch(3, "--output-dir", str(out), "--resume", "--steps", "8", cwd=tmp_path)
    assert "resumed from step 6 (saved on 2 processes, running on 3)" in second, second[-2000:]
    resumed = _losses(second)
    assert sorted(resumed) == [7, 8], second[-2000:]

    # The full weights written by save_model load into a plain model.
    from safetensors.torch import load_file

    plain = ex.TinyLM()
    plain.load_state_dict(load_file(out / "model" / "model.safetensors"))
    tokens = ex.make_tokens(192, seed=0)
    # 2 processes x 6 steps = 12 batches done; step 7 takes batches 12-14, step 8 15-17.
    step7 = tokens[12 * BATCH:15 * BATCH]
    step8 = tokens[15 * BATCH:18 * BATCH]
    with torch.no_grad():
        assert ex.lm_loss(plain, ex.make_tokens(16, seed=1)).item() == pytest.approx(
            saved_eval, abs=2e-6)
        assert ex.lm_loss(plain, step7).item() == pytest.approx(resumed[7], abs=2e-6)

    # The sharded checkpoint (model and AdamW moments) loads into a plain model on one process
    # and takes the same step as the 3 processes did.
    with accel.distributed():
        model = ex.TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        with pytest.warns(UserWarning, match="saved by 2 processes and is loaded by 1"):
            info = accel.load_state(out / "checkpoints", model=model, optimizer=optimizer)
        assert info is not None and info.step == 6 and info.world_size == 2
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
        assert optimizer.state_dict()["state"], "the AdamW moments were not loaded"
        # The 3 processes average their gradients: the mean loss over their 12 sequences.
        ex.lm_loss(model, step7).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            assert ex.lm_loss(model, step8).item() == pytest.approx(resumed[8], abs=1e-5)


@pytest.mark.ci_extra
@pytest.mark.slow
def test_fsdp_bench_smoke_run(tmp_path: pathlib.Path) -> None:
    bench = EXAMPLE.parents[1] / "bench" / "fsdp.py"
    # as `python bench/fsdp.py ...` (raises if it fails)
    done = run_script(bench, "--windows", "2", "--steps", "2", "--step-procs", "2",
                      "--ckpt-width", "64", "--ckpt-blocks", "2", "--repeat", "1", "--dir",
                      str(tmp_path), world_size=1, launch=False, env={"OMP_NUM_THREADS": "1"})
    report = json.loads(done.output)
    for accumulation in (1, 4):
        steps = report[f"procs=2,accumulation={accumulation}"]
        assert steps["raw_us"] > 0 and steps["accel_us"] > 0
        assert isinstance(steps["accel_own_us"], float)
        assert any("accumulation.py" in row for row in steps["cprofile_top"])
        assert len(steps["peak_rss_mib"]) == 2
    ckpt = report["checkpoint"]
    # 2 x Linear(64, 64): weights, biases and two AdamW moments, 4 bytes each
    assert ckpt["state_bytes"] == 2 * (64 * 64 + 64) * 3 * 4
    assert all(size >= ckpt["state_bytes"] for size in ckpt["files_bytes"].values())
    assert set(ckpt["seconds_median"]) == {"accel_save", "accel_load", "dcp_save", "dcp_load"}
    assert ckpt["ratios"]["save_accel_vs_dcp"] > 0 and ckpt["ratios"]["load_accel_vs_dcp"] > 0
    assert list(tmp_path.iterdir()) == []  # the bench removed its checkpoints

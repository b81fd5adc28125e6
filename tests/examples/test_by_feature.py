"""examples/by_feature: each script runs on 2 CPU processes and does what it says."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
import torch
from safetensors.torch import load_file

from accel.testing import run_script

BY_FEATURE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "by_feature"



def _launch(tmp_path: pathlib.Path, script: str, *args: str) -> str:
    """Run the script on 2 CPU processes as ``accel launch --nproc-per-node 2 --cpu`` would
    (forked from warm workers by ``run_script``, which raises if a rank fails); return every
    rank's stdout, in rank order."""
    return run_script(BY_FEATURE / script, *args, world_size=2, cwd=tmp_path,
                      env={"OMP_NUM_THREADS": "1"}).output


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match is not None, f"{pattern!r} not in output:\n{text[-3000:]}"
    return float(match.group(1))


def test_readme_lists_every_example() -> None:
    readme = (BY_FEATURE / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in BY_FEATURE.glob("*.py"))
    assert len(scripts) == 13
    for name in scripts:
        assert f"`{name}`" in readme, name


def test_checkpointing_resume_equals_uninterrupted_run(tmp_path: pathlib.Path) -> None:
    full = _launch(tmp_path, "checkpointing.py", "--output-dir", "ck", "--checkpointing-steps",
                   "5", "--final-weights", "full.safetensors")
    assert "finished at step 36" in full
    saved = sorted(p.name for p in (tmp_path / "ck").glob("checkpoint_*"))
    assert saved == [f"checkpoint_{s}" for s in (10, 15, 20, 25, 30, 35, 5)]
    # step 20 is batch 8 of epoch 1's 12: the loader resumes mid-epoch
    resumed = _launch(tmp_path, "checkpointing.py", "--output-dir", "ck2",
                      "--resume-from-checkpoint", "ck/checkpoint_20",
                      "--final-weights", "resumed.safetensors")
    assert "resumed from checkpoint_20 at step 20" in resumed
    assert "epoch 0:" not in resumed and "finished at step 36" in resumed
    a, b = load_file(tmp_path / "full.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert sorted(a) == sorted(b) and len(a) == 4
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # the epoch accuracies printed after the resume are the uninterrupted run's
    assert full.splitlines()[-3:-1] == resumed.splitlines()[-3:-1]


def test_early_stopping_stops_every_rank_at_the_same_step(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "early_stopping.py")
    found = re.findall(r"rank (\d): stopped at step (\d+) of (\d+) \(trigger set here at step "
                       r"(\w+)\)", out)
    assert sorted(r for r, *_ in found) == ["0", "1"], out
    steps = {int(step) for _, step, _, _ in found}
    assert len(steps) == 1, found
    (step,) = steps
    assert step < int(found[0][2])  # stopped early
    setters = [r for r, _, _, at in found if at != "None"]
    assert setters, found  # some rank set the trigger, and the others followed at once
    assert all(int(at) == step for _, _, _, at in found if at != "None")


def test_memory_finder_settles_on_the_size_that_fits(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "memory.py", "--simulated-max-batch", "16")
    tried = [int(s) for s in re.findall(r"trying batch size (\d+)", out)]
    assert tried == [128, 64, 32, 16]
    assert "rank 0: settled on batch size 16" in out
    assert "rank 1: settled on batch size 16" in out
    assert _number(r"epoch 1: accuracy ([\d.]+)", out) > 0.5


def test_multi_process_metrics_count_every_sample_once(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "multi_process_metrics.py", "--epochs", "1")
    match = re.search(r"gather_for_metrics: (\d+) samples, accuracy ([\d.]+); manual: (\d+) "
                      r"samples, accuracy ([\d.]+)", out)
    assert match is not None, out
    assert match.group(1) == match.group(3) == "37"  # 37 is not a multiple of 2 * 8
    assert match.group(2) == match.group(4)


def test_tracking_writes_jsonl_and_custom_csv(tmp_path: pathlib.Path) -> None:
    _launch(tmp_path, "tracking.py", "--with-tracking", "--project-dir", "runs",
            "--run-name", "demo", "--epochs", "2")
    run = tmp_path / "runs" / "demo"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.csv",
                                                      "metrics.jsonl"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]  # one row per epoch, from one process only
    assert [r["step"] for r in rows] == [8, 16]
    assert rows[1]["train_loss"] < rows[0]["train_loss"]
    csv_lines = (run / "metrics.csv").read_text().splitlines()
    assert csv_lines[0] == "step,accuracy,train_loss,epoch" and len(csv_lines) == 3
    assert json.loads((run / "config.json").read_text())["lr"] == 0.01


def test_gradient_accumulation_equals_the_large_batch(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "gradient_accumulation.py", "--gradient-accumulation-steps", "4")
    assert "epoch 1: 16 optimizer steps" in out  # 256 samples / (4 * 4 * 2) per epoch
    assert "samples per optimizer step: 32" in out
    assert _number(r"max difference from the large batch: (\S+)", out) < 1e-6


def test_automatic_gradient_accumulation_keeps_the_observed_batch(
    tmp_path: pathlib.Path,
) -> None:
    out = _launch(tmp_path, "automatic_gradient_accumulation.py", "--simulated-max-batch", "8")
    assert [int(s) for s in re.findall(r"trying batch size (\d+)", out)] == [32, 16, 8]
    assert "batch size 8 x 4 accumulation steps: 8 optimizer steps" in out
    assert "settled on batch size 8 with 4 accumulation steps" in out
    assert "batch size 32 x 1 accumulation steps: 8 optimizer steps" in out
    assert _number(r"max difference from the observed batch: (\S+)", out) < 1e-6


def test_cross_validation_runs_every_fold_and_gathers_the_test_set(
    tmp_path: pathlib.Path,
) -> None:
    out = _launch(tmp_path, "cross_validation.py", "--num-folds", "3", "--epochs", "2")
    folds = re.findall(r"fold (\d): validation accuracy ([\d.]+) \((\d+) samples\)", out)
    assert [f for f, _, _ in folds] == ["0", "1", "2"]
    assert all(n == "100" for _, _, n in folds)  # 300 samples / 3 folds, none repeated
    assert "ensemble of 3 folds" in out
    assert "(45 samples, labels in dataset order: True)" in out
    assert _number(r"test accuracy ([\d.]+)", out) > 0.5


def test_profiler_writes_a_trace_per_rank(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "profiler.py", "--output-trace-dir", "traces", "--record-shapes")
    assert "Self CPU time total" in out
    for rank in (0, 1):
        trace = json.loads((tmp_path / "traces" / f"profile_{rank}.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert "aten::linear" in names  # the model's forward was recorded
        assert any(event.get("args", {}).get("Input Dims") for event in trace["traceEvents"])


def test_autoregressive_accumulation_normalises_by_all_tokens(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "gradient_accumulation_for_autoregressive_models.py",
                  "--gradient-accumulation-steps", "3", "--epochs", "1")
    steps = re.findall(r"update \d: (\d+) tokens, loss ([\d.]+) \(large batch ([\d.]+)\)", out)
    assert len(steps) == 5  # 13 batches per rank: 4 updates of 3 and one of 1
    assert all(loss == large for _, loss, large in steps)
    assert len({tokens for tokens, _, _ in steps}) > 1  # the token counts differ per step
    assert _number(r"max difference from the large batch: (\S+)", out) < 1e-6
    assert re.search(r"over (\d+) tokens \(the validation set has \1\)", out), out


@pytest.mark.skipif(importlib.util.find_spec("schedulefree") is None,
                    reason="schedulefree is not installed")
def test_schedule_free_train_and_eval_reach_the_optimizer(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "schedule_free.py", "--epochs", "2")
    epochs = re.findall(r"optimizer in (\w+) mode, eval\(\) moved the weights by up to (\S+)",
                        out)
    assert len(epochs) == 2
    assert all(mode == "eval" and float(moved) > 0 for mode, moved in epochs)


def test_local_sgd_ranks_agree_after_each_averaging(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "local_sgd.py", "--local-sgd-steps", "8", "--epochs", "1")
    match = re.search(r"epoch 0: LocalSGD active: True \(off on one process\), 20 steps, "
                      r"(\d+) averagings, ranks agree after each: (\w+), "
                      r"ranks differed at (\d+) of the other steps, agree at the end: (\w+)", out)
    assert match is not None, out
    assert match.groups() == ("2", "True", "18", "True")  # steps 8 and 16, then the exit


def test_ddp_comm_hook_power_sgd_with_fp16_wrapper_is_active(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "ddp_comm_hook.py", "--ddp-comm-hook", "power_sgd",
                  "--ddp-comm-wrapper", "fp16", "--matrix-approximation-rank", "2")
    assert "comm hook 'power_sgd', wrapper 'fp16'" in out
    # the fp16 wrapper: every all-reduced gradient is made of float16 values (plain DDP: none)
    assert "steps whose gradient holds only float16 values: 8 of 8" in out
    # PowerSGD (from its 2nd iteration): the (32, 8) gradient has rank 2, not 8
    assert "rank of the last (32, 8) gradient: 2" in out


def test_ddp_comm_hook_custom_callable_is_called(tmp_path: pathlib.Path) -> None:
    out = _launch(tmp_path, "ddp_comm_hook.py", "--ddp-comm-hook", "custom")
    assert "custom hook called 8 times in 8 steps" in out  # one bucket per step
    assert "rank of the last (32, 8) gradient: 8" in out

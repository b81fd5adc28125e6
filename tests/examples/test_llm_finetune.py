"""examples/llm_finetune.py: stopped by SIGTERM on 2 processes, resumed on 1, checked on 1.

A 2-process FSDP + bf16 run (gradient accumulation 2, HF gradient checkpointing), started as
`accel launch --nproc-per-node 2 --cpu` starts it, gets SIGTERM on every rank (what the
launcher forwards) after its second step: every rank saves at the same step and exits 0.
The same command with `--resume --grad-accum 4` continues on one process (`python
llm_finetune.py`: the same global batch of 16 sequences) to the last step and writes the
final weights. Both runs fork from warm workers with torch and transformers imported
(`accel.testing.start_script`/`run_script`; the launcher's own signal forwarding is tested in
tests/cli/test_preemption_launch.py). Then, in this process:

- the checkpoint's model, AdamW state and schedule, loaded into a plain model, give the loss
  the resumed run printed for its first step on the global batches the 2 processes had not
  reached yet (so the loader did not replay or skip any), and, after the same update as the
  resumed run made, its second loss;
- `AutoModelForCausalLM.from_pretrained` reads the final weights and gives the evaluation
  loss the run printed (and keeps the embeddings tied when they were).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import signal
from types import ModuleType

import pytest
import torch
from torch.utils.data import DataLoader

import accel
from accel.testing import ScriptResult, run_script, start_script

transformers = pytest.importorskip("transformers")
# the example's transformers, imported once by the warm server instead of in each process
pytestmark = pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama",
                                 "transformers.models.gpt2.modeling_gpt2")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "llm_finetune.py"
MAX_STEPS = 10
# the defaults: 4 sequences per batch; 2 processes x accumulation 2 = 1 process x 4
BATCH, PER_STEP = 4, 4

CASES = {
    "llama": [],
    "gpt2-tied": ["--model-type", "gpt2", "--tie-word-embeddings"],
}


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llm_finetune_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str | None]:
    """This process's environment less launcher variables, one thread per process."""
    drop = ("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
    removed: dict[str, str | None] = {k: None for k in os.environ if k.startswith(drop)}
    return {**removed, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _text(done: ScriptResult) -> str:
    """Every rank's stdout and stderr, for failure messages."""
    return "\n".join(out + err for out, err in zip(done.stdout, done.stderr, strict=True))


def _losses(output: str) -> dict[int, float]:
    found = re.findall(r"^step (\d+) loss (\d+\.\d+) lr", output, flags=re.MULTILINE)
    return {int(step): float(loss) for step, loss in found}


def _global_batches(ex: ModuleType, args: object, count: int) -> list[torch.Tensor]:
    """The first ``count`` batches of the shuffled training loader, on one process.

    Batch ``i`` of the unsharded loader goes to rank ``i % world_size``, so this is also the
    order in which 2 processes take them, two at a time.
    """
    train, _ = ex.make_blocks(args.train_file, args.block_size)  # type: ignore[attr-defined]
    global_batch = BATCH * PER_STEP
    train = train[: len(train) // global_batch * global_batch]
    batches: list[torch.Tensor] = []
    with accel.distributed(seed=0):
        loader = accel.prepare_data_loader(DataLoader(train, batch_size=BATCH, shuffle=True))
        while len(batches) < count:
            batches.extend(loader)  # one epoch; the next iteration is the next epoch's order
    return batches[:count]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.ci_extra
def test_stopped_on_two_processes_resumed_on_one(case: str, tmp_path: pathlib.Path) -> None:
    ex = _example()
    out = tmp_path / "run"
    flags = ["--output-dir", str(out), "--max-steps", str(MAX_STEPS), "--save-every", "3",
             "--eval-every", "0", *CASES[case]]

    with start_script(EXAMPLE, *flags, world_size=2, env=_env(), cwd=tmp_path,
                      timeout=300) as run:
        run.wait_for("step 2 loss")
        run.send_signal(signal.SIGTERM)  # every rank, as the launcher forwards it
        first = run.wait(check=False)
    assert first.exit_codes == (0, 0), _text(first)[-4000:]  # all 2 workers exited 0
    output = first.output
    saved = re.findall(r"^stop requested: saved step (\d+), exiting$", output,
                       flags=re.MULTILINE)
    assert len(saved) == 1, output[-3000:]  # printed once (main process)
    stopped_at = int(saved[0])
    assert 2 <= stopped_at < MAX_STEPS - 1, output[-3000:]
    assert sorted(_losses(output)) == list(range(1, stopped_at + 1))
    assert "finished at step" not in output
    assert not (out / "final").exists()
    kept = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("checkpoint_*"))
    assert kept[-1] == stopped_at and len(kept) <= 2, kept  # --total-limit 2 (default)

    # One process, twice the accumulation: the same global batch. No checkpoints of its own
    # (--save-every 0), so that rotation keeps the one loaded below.
    resume = ["--resume", "--grad-accum", "4", "--save-every", "0"]
    done = run_script(EXAMPLE, *flags, *resume, world_size=1, env=_env(), cwd=tmp_path,
                      timeout=300, check=False, launch=False)
    assert done.ok, _text(done)[-6000:]
    stdout = done.stdout[0]
    assert (f"resumed from step {stopped_at} (checkpoint_{stopped_at}, saved on 2 processes, "
            "running on 1)") in stdout, stdout[-2000:]
    resumed = _losses(stdout)
    assert sorted(resumed) == list(range(stopped_at + 1, MAX_STEPS + 1)), stdout[-2000:]
    assert f"finished at step {MAX_STEPS}" in stdout
    final_eval = re.findall(rf"^eval loss (\d+\.\d+) perplexity \S+ at step {MAX_STEPS}$",
                            stdout, flags=re.MULTILINE)
    assert len(final_eval) == 1, stdout[-2000:]

    args = ex.parse_args(flags)
    batches = _global_batches(ex, args, PER_STEP * (stopped_at + 2))
    next_step = batches[PER_STEP * stopped_at:PER_STEP * (stopped_at + 1)]
    after_next = batches[PER_STEP * (stopped_at + 1):]
    # The checkpoint in a plain model, AdamW and schedule on one process, as the resumed run.
    with accel.distributed(mixed_precision="bf16", gradient_accumulation_steps=PER_STEP):
        model = transformers.AutoModelForCausalLM.from_config(ex.make_config(args))
        optimizer = ex.make_optimizer(model, args.lr, args.weight_decay)
        model, optimizer = accel.prepare(model, optimizer)
        scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, args.warmup_steps,
                                                                 MAX_STEPS)
        with pytest.warns(UserWarning, match="saved by 2 processes and is loaded by 1"):
            info = accel.load_state(out / "checkpoints" / f"checkpoint_{stopped_at}",
                                    model=model, optimizer=optimizer, scheduler=scheduler)
        assert info is not None and info.step == stopped_at and info.world_size == 2
        assert optimizer.state_dict()["state"], "the AdamW moments were not loaded"
        losses = []
        for batch in next_step:  # the update of step stopped_at + 1
            with accel.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accel.backward(loss)
                accel.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        scheduler.step()
        assert sum(losses) / PER_STEP == pytest.approx(resumed[stopped_at + 1], abs=2e-6)
        with torch.no_grad():
            losses = [model(input_ids=b, labels=b).loss.item() for b in after_next]
        assert sum(losses) / PER_STEP == pytest.approx(resumed[stopped_at + 2], abs=2e-6)

    # The final weights load with plain transformers and give the printed evaluation loss.
    final = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    tied = final.get_output_embeddings().weight is final.get_input_embeddings().weight
    assert tied == ("--tie-word-embeddings" in CASES[case])
    _, eval_blocks = ex.make_blocks(args.train_file, args.block_size)
    with accel.distributed(mixed_precision="bf16"):  # as the resumed run evaluated
        final, loader = accel.prepare(final, DataLoader(eval_blocks, batch_size=BATCH))
        assert ex.evaluate(final, loader) == pytest.approx(float(final_eval[0]), abs=2e-6)

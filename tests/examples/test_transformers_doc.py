"""Every Python block of docs/transformers.md runs as the page says.

Each block is marked ``<!-- doc-test: launch -->`` (run on 2 CPU processes as ``accel
launch`` runs them) or ``<!-- doc-test: python -->`` (one plain process). Later blocks use
what earlier ones wrote (``tiny-llama``, ``base-model``...), and only ``python`` blocks read
what ``launch`` blocks wrote, so the launch blocks run first, in page order, in one launch of
2 processes (each block as its own ``__main__``), then the python blocks, in one plain
process, in a shared working directory. Both run through ``accel.testing.run_script``
(processes forked from warm workers that have torch, transformers and peft imported, with
the environment ``accel launch`` gives its workers); ``accel launch`` itself is tested in
tests/cli.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from accel.testing import ScriptResult, run_script

pytest.importorskip("transformers")
pytest.importorskip("peft")
# what the blocks import, imported once by the warm server instead of in each process
pytestmark = pytest.mark.preload("transformers", "peft",
                                 "transformers.models.llama.modeling_llama",
                                 "transformers.models.gpt2.modeling_gpt2")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "transformers.md"
BLOCK = re.compile(r"(?:<!-- doc-test: (launch|python) -->\n)?```python\n(.*?)```", re.DOTALL)
# Under `accel launch` the runner makes the process group once: each block's
# `accel.distributed()` then uses it and leaves it alone (a second group made and destroyed in
# the same worker process would rendezvous again through the launcher's store, which hangs).
RUNNER = """
import os, runpy, sys
import torch.distributed as dist
if "RANK" in os.environ:
    dist.init_process_group("gloo")
for path in sys.argv[1:]:
    print(f"=== {path}", flush=True)
    runpy.run_path(path, run_name="__main__")
if dist.is_initialized():
    dist.destroy_process_group()
"""


def _blocks() -> list[tuple[str, str]]:
    return [(kind, code) for kind, code in BLOCK.findall(DOC.read_text(encoding="utf-8"))]


def test_every_python_block_is_marked() -> None:
    blocks = _blocks()
    assert blocks, "no python blocks found"
    unmarked = [code.splitlines()[0] for kind, code in blocks if not kind]
    assert not unmarked, f"python blocks without a doc-test marker: {unmarked}"


def _run(runner: pathlib.Path, blocks: list[str], cwd: pathlib.Path, launch: bool) -> str:
    """The runner over ``blocks``: on 2 processes as ``accel launch --nproc-per-node 2 --cpu``
    runs it, or (``launch=False``) as ``python runner.py``; every rank's stdout."""
    drop = ("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(drop)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done: ScriptResult = run_script(runner, *blocks, world_size=2 if launch else 1, env=env,
                                    cwd=cwd, timeout=600, check=False, launch=launch)
    assert done.ok, "\n".join(out[-3000:] + err[-5000:]
                              for out, err in zip(done.stdout, done.stderr, strict=True))
    return done.output


@pytest.mark.slow
@pytest.mark.ci_extra
def test_doc_blocks_run(tmp_path: pathlib.Path) -> None:
    files: dict[str, list[str]] = {"launch": [], "python": []}
    for i, (kind, code) in enumerate(_blocks()):
        path = tmp_path / f"block{i:02d}_{kind}.py"
        path.write_text(code, encoding="utf-8")
        files[kind].append(str(path))
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER, encoding="utf-8")

    launched = _run(runner, files["launch"], tmp_path, launch=True)
    # every rank's output, rank 0's first (match the text, not the line ends, as when the
    # ranks shared one stdout)
    perplexities = re.findall(r"epoch (\d): perplexity (\d+\.\d+)", launched)
    assert [epoch for epoch, _ in perplexities] == ["0", "1", "2"], launched[-3000:]
    assert float(perplexities[-1][1]) < float(perplexities[0][1])  # the loop learns
    assert launched.count("finished at step 12") == 1, launched[-3000:]
    assert (tmp_path / "gpt2-run" / "checkpoint_12").is_dir()
    assert sorted(p.name for p in (tmp_path / "lora-adapter").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"]

    printed = _run(runner, files["python"], tmp_path, launch=False)
    assert "'disk'" in printed, printed[-3000:]  # the device map printed by the last block

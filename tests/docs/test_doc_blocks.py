"""Every Python block of README.md and docs/*.md that is meant to run, runs.

Each Python block carries a doc-test marker (tests/docs/blocks.py says what each kind means):
a block without one fails :func:`test_every_python_block_has_a_marker`, so none is skipped by
accident. The one-process blocks of a page run in page order, in the pytest process, in a
temporary directory holding the files the pages read (tests/docs/fixtures.py), from a fresh
namespace of the fixtures or (``continue``) the previous block's. ``ci_extra`` and ``launch``
blocks run in processes of their own through ``accel.testing.run_script`` (the ci_extra step of
.ci/run); ``gpu`` blocks run where CUDA is. docs/transformers.md's blocks, which build on one
another's files across processes, are run by tests/examples/test_transformers_doc.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import accel.errors
from accel.testing import run_script
from tests.docs.blocks import ROOT, Block, all_blocks, call_tests
from tests.docs.fixtures import namespace, write_files

OWN_TEST = "docs/transformers.md"  # run by tests/examples/test_transformers_doc.py
RUNNER = Path(__file__).with_name("_run_block.py")
BLOCKS = all_blocks()
PYTHON = [b for b in BLOCKS if b.lang in ("python", "py")]
IN_PROCESS = [b for b in PYTHON if b.kind in ("python", "continue") and not b.ci_extra
              and b.page != OWN_TEST]
PAGES = sorted({b.page for b in IN_PROCESS})
OWN_PROCESS = [b for b in PYTHON if b.page != OWN_TEST
               and (b.kind == "launch" or (b.kind == "python" and b.ci_extra))]
GPU = [b for b in PYTHON if b.kind == "gpu"]


def test_every_python_block_has_a_marker() -> None:
    unmarked = [b.id for b in PYTHON if b.kind is None]
    assert not unmarked, (
        f"Python blocks without a doc-test marker: {unmarked}. Put a line such as "
        "`<!-- doc-test: python -->` or `<!-- doc-test: no -- WHY -->` just above each "
        "(tests/docs/blocks.py lists the kinds).")
    # a block that is Python in all but its fence's label is labelled, so that it is marked
    unlabelled = []
    for b in BLOCKS:
        if b.lang == "" and "accel." in b.code:
            try:
                compile(b.code, b.id, "exec", dont_inherit=True)
            except SyntaxError:
                continue
            unlabelled.append(b.id)
    assert not unlabelled, f"blocks that are Python: fence them as ```python: {unlabelled}"
    stray = [b.id for b in BLOCKS if b.kind is not None and b.lang not in ("python", "py")]
    assert not stray, f"doc-test markers above blocks that are not Python: {stray}"
    chained = [b.id for b in PYTHON if b.kind == "continue" and b.ci_extra]
    assert not chained, f"a `continue` block runs with its page, never ci_extra: {chained}"
    for b in PYTHON:
        if b.raises is not None:
            assert isinstance(getattr(accel.errors, b.raises, None), type), (
                f"{b.id}: `raises {b.raises}` names no error of accel.errors")


def _run_in_process(block: Block, ns: dict[str, Any], tmp: Path) -> None:
    code = compile(block.code, block.id, "exec", dont_inherit=True)
    if block.raises is None:
        exec(code, ns)
    else:
        with pytest.raises(getattr(accel.errors, block.raises)):
            exec(code, ns)
    call_tests(ns, tmp)


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_files()
    ns: dict[str, Any] | None = None
    for block in (b for b in IN_PROCESS if b.page == page):
        if block.kind == "python" or ns is None:
            assert block.kind == "python", f"{block.id}: `continue` with no block before it"
            ns = namespace(page)
        _run_in_process(block, ns, tmp_path)


def _env() -> dict[str, str | None]:
    drop = ("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith(drop)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return env


@pytest.mark.ci_extra
@pytest.mark.parametrize("block", OWN_PROCESS, ids=lambda b: b.id)
def test_heavy_blocks_run(block: Block, tmp_path: Path) -> None:
    """A ``launch`` block on 2 processes as ``accel launch`` runs it, a ``ci_extra`` one in
    a plain process of its own."""
    launch = block.kind == "launch"
    done = run_script(RUNNER, block.page, str(block.line), world_size=2 if launch else 1,
                      launch=launch, env=_env(), cwd=tmp_path, timeout=300, check=False)
    assert done.ok, "\n".join(out[-3000:] + err[-5000:]
                              for out, err in zip(done.stdout, done.stderr, strict=True))
    assert done.output.count(f"=== {block.id} ran") == (2 if launch else 1), done.output[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the block needs a CUDA device")
@pytest.mark.parametrize("block", GPU, ids=lambda b: f"{b.id} ({b.reason})")
def test_gpu_blocks_run(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_files()
    _run_in_process(block, namespace(block.page), tmp_path)

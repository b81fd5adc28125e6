"""Run one block of a page as a script: ``python _run_block.py PAGE LINE`` (from any directory).

What tests/docs/test_doc_blocks.py starts through ``accel.testing.run_script`` for the blocks
that run in processes of their own (``launch`` blocks on 2 processes, ``ci_extra`` ones on
one). Under ``accel launch`` (``RANK`` set) the process group is made here, once, so that the
block's ``accel.distributed()`` uses it and leaves it alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist

from tests.docs.blocks import ROOT, blocks, call_tests
from tests.docs.fixtures import namespace, write_files


def main(page: str, line: int) -> None:
    block = next(b for b in blocks(ROOT / page) if b.line == line)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    try:
        if os.environ.get("RANK", "0") == "0":
            write_files()
        if dist.is_initialized():
            dist.barrier()
        ns = namespace(page)
        exec(compile(block.code, block.id, "exec", dont_inherit=True), ns)
        call_tests(ns, Path.cwd())
        print(f"=== {block.id} ran", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

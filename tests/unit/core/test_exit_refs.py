"""Collective work is kept referenced to the interpreter's end where gloo's worker thread would
otherwise free it late (accel.core.exit_refs).

torch 2.13's worker thread takes the GIL when it drops the last C++ reference to a tensor Python
also sees; doing so while the interpreter finalizes aborts the process ("terminate called
without an active exception"). That aborted rank 0 of a DeepSpeed job stopped by SIGTERM (it had
saved and left its block cleanly) in about one launch in ten in CI: the block's final barrier,
released late by a worker thread, held the all-gather still in flight when it was issued.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from accel.core import exit_refs
from accel.testing import run_script

CLEAN_END = """
import torch
import torch.distributed as dist
import accel
from accel.core import exit_refs

with accel.distributed() as st:
    gathered = accel.gather_object({"rank": st.rank})  # an all-gather, then the block's end
print("kept", sum(isinstance(o, dist.Work) for o in exit_refs._KEPT), len(gathered))
"""


def test_the_block_that_made_the_group_keeps_its_final_barrier(tmp_path: Path) -> None:
    (tmp_path / "end.py").write_text(CLEAN_END)
    result = run_script("end.py", world_size=2, cwd=tmp_path)
    assert [out.strip() for out in result.stdout] == ["kept 1 2", "kept 1 2"]


@pytest.fixture
def one_process_group() -> object:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_final_barrier_keeps_its_work(
    one_process_group: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exit_refs, "_KEPT", [])
    dist.all_reduce(torch.ones(3))
    assert exit_refs.final_barrier() is True
    assert [type(o) for o in exit_refs._KEPT] == [dist.Work]


def test_final_barrier_after_a_peer_failed_returns_false(
    one_process_group: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "barrier", broken)
    assert exit_refs.final_barrier() is False

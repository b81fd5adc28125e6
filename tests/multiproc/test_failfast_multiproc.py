"""A rank that raises inside ``accel.distributed()`` leaves at once, and its peers are released.

Leaving the block on an exception makes no collective: a failing rank that waited in a barrier
for peers still training (or blocked in a collective it will never join) would hang the job
until the 30-minute collective timeout. Each run here is bounded far below that, so a
regression fails instead of hanging.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

import pytest
import torch

import accel
from accel.testing import run_distributed, start_script


class ShardError(Exception):
    pass


def _raise_on_rank_one_while_rank_zero_trains() -> int:
    """Rank 1 raises at step 3; rank 0 trains on (DDP: it blocks in step 3's allreduce)."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accel.prepare(model, opt)
    for step in itertools.count():
        if accel.state().rank == 1 and step == 3:
            raise ShardError("corrupt shard at step 3 on rank 1")
        accel.backward(model(torch.randn(8, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return 0


def _raise_on_rank_one_while_rank_zero_waits() -> int:
    """Rank 0 waits in a collective that rank 1, raising first, never joins."""
    if accel.state().rank == 1:
        raise ShardError("rank 1 failed before the gather")
    accel.gather(torch.ones(2))
    return 0


@pytest.mark.parametrize(
    "body", [_raise_on_rank_one_while_rank_zero_trains, _raise_on_rank_one_while_rank_zero_waits]
)
def test_run_distributed_surfaces_the_raising_ranks_error(body: object) -> None:
    # the peer's own failure (a lost connection) must not take the place of the cause
    with pytest.raises(ShardError, match="rank 1") as info:
        run_distributed(body, world_size=2, timeout=30)  # type: ignore[arg-type]
    assert "Traceback from rank 1 of 2" in str(info.value.__cause__)


# The same loop in a script that owns its process group: two plain processes, no launcher to
# stop the survivor, so each must end by itself.
SCRIPT = '''
import itertools
import torch
import accel

def load_shard(step):
    raise ValueError(f"corrupt shard at step {step} on rank 1")

with accel.distributed() as st:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accel.prepare(model, opt)
    for step in itertools.count():
        if st.rank == 1 and step == 3:
            load_shard(step)
        accel.backward(model(torch.randn(8, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_without_a_launcher_both_ranks_exit_with_their_errors(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    drop = ("ACCEL_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_", "TORCHELASTIC_")
    base: dict[str, str | None] = {k: None for k in os.environ if k.startswith(drop)}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # each rank `python train.py` in a process of its own (forked from warm workers), with
    # only the variables a user would export; each must end by itself within the bound
    with start_script("train.py", world_size=1, launch=False, cwd=tmp_path, timeout=90,
                      env={**base, "RANK": "0", "LOCAL_RANK": "0"}) as rank0, \
            start_script("train.py", world_size=1, launch=False, cwd=tmp_path, timeout=90,
                         env={**base, "RANK": "1", "LOCAL_RANK": "1"}) as rank1:
        done = [rank0.wait(check=False), rank1.wait(check=False)]
    logs = [d.stdout[0] + d.stderr[0] for d in done]
    assert not any(d.timed_out for d in done), logs  # no hang
    assert [d.exit_codes for d in done] == [(1,), (1,)], logs
    # the failing rank exits with its traceback (not an abort at exit that would replace it)
    assert "in load_shard" in logs[1]
    assert "ValueError: corrupt shard at step 3 on rank 1" in logs[1]
    # the survivor, blocked in the allreduce, is released with a lost-connection error
    assert "Traceback" in logs[0] and "ValueError" not in logs[0]

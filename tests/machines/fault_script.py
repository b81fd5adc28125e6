"""A training job for the fault tests: DDP steps on CPU until stopped, marks on the way.

``python fault_script.py MODE MARKS [DISK]`` under ``accel launch``: ``MODE`` is ``train``
(steps forever), ``slow`` (machine 1 pauses 3 x the liveness timeout mid-training: a sleep, a
GIL-holding Python loop, then a long write, then all finish), ``save-local`` / ``save-shared``
(a ``save_state`` at step 3, then at step 6 a second one in which machine 1 stops in the middle
of writing its files and marks ``saving``: the test kills it there), ``resume-local`` /
``resume-shared`` (``load_state`` of what is there, print the step it resumed from, then save
again at that step + 4: the save that removes the dead one's leftovers).
``MARKS`` is a directory on the shared disk where each rank writes ``<rank>.step`` once it
trains; the ``-local`` checkpoints go to ``DISK/ckpt`` (each machine's own disk, one copy per
machine), the ``-shared`` ones to ``MARKS/ckpt``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import accel

MODE, MARKS = sys.argv[1], Path(sys.argv[2])
KIND = MODE.partition("-")[2]  # local / shared, for the save and resume modes
ROOT = f"{sys.argv[3]}/ckpt" if KIND == "local" else str(MARKS / "ckpt")
PAUSE = 3 * float(os.environ.get("ACCEL_LIVENESS_TIMEOUT", "10"))


def _pause(kind: str) -> None:
    print(f"machine 1 pauses {PAUSE:.0f}s ({kind})", flush=True)
    end = time.monotonic() + PAUSE
    if kind == "sleep":
        time.sleep(PAUSE)
    elif kind == "gil":
        count = 0
        while time.monotonic() < end:  # pure Python: holds the GIL but for the switch interval
            count += 1
    else:  # a long write
        with open(MARKS / "big.bin", "wb") as file:
            while time.monotonic() < end:
                file.write(os.urandom(1 << 20))


def _stall_the_writes() -> None:
    """This machine's save stops after its first write, as a machine dying mid-save would."""
    from accel._files import writer

    write = writer._pwrite_all

    def first_then_stall(fd: int, data: memoryview, offset: int) -> None:
        write(fd, data, offset)
        (MARKS / "saving").write_text(str(os.getpid()))
        time.sleep(3600)

    writer._pwrite_all = first_then_stall


def _save(step: int) -> None:
    accel.save_state(ROOT, step=step, on_each_node=KIND == "local", model=model, optimizer=opt)


with accel.distributed(cpu=True, seed=0) as st:
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accel.prepare(model, opt)
    if MODE.startswith("resume"):
        info = accel.load_state(ROOT, on_each_node=KIND == "local", model=model, optimizer=opt)
        print(f"rank {st.rank} resumed from {accel.latest_checkpoint(ROOT)} step {info.step}",
              flush=True)
        _save(info.step + 4)
        sys.exit(0)
    step = 0
    while True:
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            (MARKS / f"{st.rank}.step").write_text(str(step))
        if MODE == "slow" and st.node_rank == 1 and step in (5, 6, 7):
            _pause({5: "sleep", 6: "gil", 7: "write"}[step])
        if MODE.startswith("save") and step == 3:
            _save(3)
        if MODE.startswith("save") and step == 6:
            if st.node_rank == 1:
                _stall_the_writes()
            _save(6)
        if MODE == "slow" and step == 10:
            break
        time.sleep(0.02)
print(f"rank {st.rank} done", flush=True)

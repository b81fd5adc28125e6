"""A training job for the fault tests: DDP steps on CPU until stopped, marks on the way.

``python fault_script.py MODE MARKS`` under ``accel launch``: ``MODE`` is ``train`` (steps
forever), ``slow`` (machine 1 pauses 3 x the liveness timeout mid-training: a sleep, a
GIL-holding Python loop, then a long write, then all finish). ``MARKS`` is a directory on the
shared disk where each rank writes ``<rank>.step`` once it trains.
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


with accel.distributed(cpu=True, seed=0) as st:
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accel.prepare(model, opt)
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
        if MODE == "slow" and step == 10:
            break
        time.sleep(0.02)
print(f"rank {st.rank} done", flush=True)

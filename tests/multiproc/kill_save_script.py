"""Saves checkpoints in a loop until killed; the test SIGKILLs it at random moments.

Every checkpoint's weights equal its step, so a loaded checkpoint is consistent exactly when
all of its weights equal the step it reports.
"""

import sys

import torch
from torch import nn

import accel

root = sys.argv[1]
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
with accel.distributed():
    info = accel.load_state(root, missing_ok=True, model=model)
    step = info.step + 1 if info and info.step is not None else 1
    print("START", step, flush=True)
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        accel.save_state(root, step=step, total_limit=3, model=model)
        print("SAVED", step, flush=True)
        step += 1

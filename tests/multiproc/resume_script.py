"""Training that checkpoints every few steps and resumes from the latest checkpoint.

Usage: resume_script.py ROOT TOTAL_STEPS DIE_AT OUT   (DIE_AT=0: never die)
Dropout, a shuffled loader crossing epoch boundaries, gradient accumulation (saves land
mid-cycle), a scheduler and AdamW: the resumed run must end with the same weights.
"""

import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel

root, total, die_at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with accel.distributed(gradient_accumulation_steps=2, seed=1234):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(44, 6, generator=g), torch.randn(44, 1, generator=g))
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = accel.prepare(model, opt, loader, sched)
    objects = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
    info = accel.load_state(root, missing_ok=True, **objects)
    step = info.step if info and info.step is not None else 0
    while step < total:
        for x, y in loader:
            with accel.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accel.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            step += 1
            if step % 3 == 0:
                accel.save_state(root, step=step, total_limit=2, **objects)
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= total:
                break
    if accel.state().is_main_process:
        accel.save(accel.get_state_dict(model), out)

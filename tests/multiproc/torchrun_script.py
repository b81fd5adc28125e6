"""Run under torchrun by test_torchrun.py: distributed() creates and destroys the group."""

import json
import sys

import torch
import torch.distributed as dist

import accel

with accel.distributed(gradient_accumulation_steps=2) as st:
    created = accel.core.scope.scope().created_group
    total = accel.reduce(torch.tensor([float(st.rank + 1)])).item()
    gathered = accel.gather_object(st.rank)
    if st.is_main_process:
        sys.stdout.write(json.dumps({
            "world": st.world_size, "created": created, "total": total, "gathered": gathered,
            "backend": st.backend, "local_world": st.local_world_size,
        }) + "\n")  # one write: the ranks share the pipe, unbuffered under torchrun
        sys.stdout.flush()
sys.stdout.write(f"INITIALISED_AFTER={dist.is_initialized()}\n")  # one write: ranks share the pipe

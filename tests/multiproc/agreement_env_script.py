"""Run by test_settings_agreement.py: each rank sets its own ACCEL_GRADIENT_ACCUMULATION_STEPS
(as machines launched with different flags would) before the outermost distributed()."""

import os
import sys

import torch.distributed as dist

import accel
from accel.errors import ConfigError

same = sys.argv[1:] == ["same"]
os.environ["ACCEL_GRADIENT_ACCUMULATION_STEPS"] = "3" if same or os.environ["RANK"] == "1" else "1"
try:
    with accel.distributed() as st:
        sys.stdout.write(f"agreed: {st.gradient_accumulation_steps}\n")
except ConfigError as exc:
    sys.stdout.write(f"{exc}\ngroup left: {not dist.is_initialized()}\n")
sys.stdout.flush()

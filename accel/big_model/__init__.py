"""Big models: build on ``meta``, place submodules by a device map, offload to CPU or disk.

``init_empty_weights`` builds a model without memory; ``infer_auto_device_map`` places whole
submodules within ``max_memory``; ``dispatch_model`` / ``cpu_offload`` / ``disk_offload`` add
forward hooks that bring offloaded weights to the execution device; and
``load_checkpoint_in_model`` / ``load_checkpoint_and_dispatch`` stream a checkpoint into such a
model one file at a time.
"""

from __future__ import annotations

from accel.big_model.device_map import get_balanced_memory, infer_auto_device_map
from accel.big_model.dispatch import cpu_offload, disk_offload, dispatch_model, remove_hooks
from accel.big_model.init import init_empty_weights, init_on_device
from accel.big_model.loading import load_checkpoint_and_dispatch, load_checkpoint_in_model

__all__ = [
    "cpu_offload",
    "disk_offload",
    "dispatch_model",
    "get_balanced_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "remove_hooks",
]

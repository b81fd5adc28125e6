"""accel: run any PyTorch training script on one CPU, one GPU, many GPUs or many machines.

No central object: ``with accel.distributed(...):`` sets the process state that plain
functions (``accel.prepare``, ``accel.backward``, ``accel.gather``...) read.

The top level holds the functions a training script calls, :class:`AccelError` and the errors
scripts catch; every other error is in :mod:`accel.errors`. The subpackages
(``accel.core``, ``accel.comm``, ``accel.data``, ``accel.precision``, ``accel.training``,
``accel.parallel``, ``accel.weights``, ``accel.checkpoint``, ``accel.big_model``,
``accel.trackers``, ``accel.launch``, ``accel.cli``, ``accel.testing``) are attributes of the
package.

Importing accel is cheap: the submodules (and torch) load on first use of a name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from accel.errors import (
    AccelError,
    CheckpointError,
    CollectiveTimeoutError,
    ConfigError,
    LaunchError,
    RemoteError,
)

__version__ = "0.1.0"
"""The installed accel version, a PEP 440 string.

Example:
    >>> accel.__version__
    '0.1.0'
"""

# public name -> module that defines it (loaded on first attribute access). No module is named
# like a public function: importing a submodule sets it as a package attribute, which would
# shadow the function of the same name (hence process_group.py for distributed(), and so on).
_LAZY: dict[str, str] = {
    "ProcessState": "accel.core.state",
    "state": "accel.core.state",
    "distributed": "accel.core.process_group",
    "on_main_process": "accel.comm.gating",
    "on_local_main_process": "accel.comm.gating",
    "on_last_process": "accel.comm.gating",
    "on_process": "accel.comm.gating",
    "on_local_process": "accel.comm.gating",
    "main_process_first": "accel.comm.gating",
    "local_main_process_first": "accel.comm.gating",
    "print": "accel.comm.gating",
    "get_logger": "accel.comm.gating",
    "gather": "accel.comm.collectives",
    "gather_object": "accel.comm.collectives",
    "reduce": "accel.comm.collectives",
    "broadcast": "accel.comm.collectives",
    "broadcast_object": "accel.comm.collectives",
    "pad_across_processes": "accel.comm.collectives",
    "split_between_processes": "accel.comm.collectives",
    "wait_for_everyone": "accel.comm.collectives",
    "set_trigger": "accel.comm.collectives",
    "check_trigger": "accel.comm.collectives",
    "gather_for_metrics": "accel.comm.metrics",
    "set_seed": "accel.core.seeding",
    # training path
    "prepare": "accel.training.preparation",
    "prepare_model": "accel.training.model",
    "unwrap_model": "accel.training.model",
    "prepare_optimizer": "accel.training.optim",
    "prepare_scheduler": "accel.training.scheduling",
    "clip_grad_norm_": "accel.training.optim",
    "clip_grad_value_": "accel.training.optim",
    "unscale_gradients": "accel.training.optim",
    "optimizer_step_was_skipped": "accel.training.optim",
    "pipeline_step": "accel.parallel.pipeline.step",
    "pipeline_forward": "accel.parallel.pipeline.outputs",
    "autocast": "accel.precision.casting",
    "backward": "accel.training.accumulation",
    "accumulate": "accel.training.accumulation",
    "sync_gradients": "accel.training.accumulation",
    "no_sync": "accel.training.accumulation",
    "trigger_sync_in_backward": "accel.training.accumulation",
    "LocalSGD": "accel.training.local_sgd",
    "prepare_data_loader": "accel.data",
    "skip_first_batches": "accel.data",
    # checkpoints
    "save": "accel.weights",
    "save_model": "accel.weights",
    "get_state_dict": "accel.weights",
    "save_state": "accel.checkpoint",
    "load_state": "accel.checkpoint",
    "latest_checkpoint": "accel.checkpoint",
    "CheckpointInfo": "accel.checkpoint",
    "load": "accel.weights",
    "wait_for_checkpoints": "accel.checkpoint",
    "stop_requested": "accel.preemption",
    # big models
    "init_empty_weights": "accel.big_model",
    "init_on_device": "accel.big_model",
    "infer_auto_device_map": "accel.big_model",
    "get_balanced_memory": "accel.big_model",
    "dispatch_model": "accel.big_model",
    "cpu_offload": "accel.big_model",
    "disk_offload": "accel.big_model",
    "remove_hooks": "accel.big_model",
    "load_checkpoint_and_dispatch": "accel.big_model",
    "load_checkpoint_in_model": "accel.big_model",
    "init_partitioned": "accel.parallel.deepspeed.zero_init",
    # tracking, progress, profiling, memory
    "tracking": "accel.trackers",
    "log": "accel.trackers",
    "get_tracker": "accel.trackers",
    "progress": "accel.progress_bar",
    "profile": "accel.profiling",
    "find_executable_batch_size": "accel.memory",
    "free_memory": "accel.memory",
    "join_uneven_inputs": "accel.comm.uneven",
    "estimate_memory": "accel.cli.estimate",
    # launching
    "notebook_launcher": "accel.launch.notebook",
    "debug_launcher": "accel.launch.notebook",
}

__all__ = [
    "AccelError",
    "CheckpointError",
    "CollectiveTimeoutError",
    "ConfigError",
    "LaunchError",
    "RemoteError",
    "__version__",
    *_LAZY,
]

if TYPE_CHECKING:  # static view of the lazy names (one line per name keeps diffs small)
    from accel import big_model as big_model
    from accel import checkpoint as checkpoint
    from accel import cli as cli
    from accel import comm as comm
    from accel import core as core
    from accel import data as data
    from accel import launch as launch
    from accel import parallel as parallel
    from accel import precision as precision
    from accel import testing as testing
    from accel import trackers as trackers
    from accel import training as training
    from accel import weights as weights
    from accel.big_model import cpu_offload as cpu_offload
    from accel.big_model import disk_offload as disk_offload
    from accel.big_model import dispatch_model as dispatch_model
    from accel.big_model import get_balanced_memory as get_balanced_memory
    from accel.big_model import infer_auto_device_map as infer_auto_device_map
    from accel.big_model import init_empty_weights as init_empty_weights
    from accel.big_model import init_on_device as init_on_device
    from accel.big_model import load_checkpoint_and_dispatch as load_checkpoint_and_dispatch
    from accel.big_model import load_checkpoint_in_model as load_checkpoint_in_model
    from accel.big_model import remove_hooks as remove_hooks
    from accel.checkpoint import CheckpointInfo as CheckpointInfo
    from accel.checkpoint import latest_checkpoint as latest_checkpoint
    from accel.checkpoint import load_state as load_state
    from accel.checkpoint import save_state as save_state
    from accel.checkpoint import wait_for_checkpoints as wait_for_checkpoints
    from accel.cli.estimate import estimate_memory as estimate_memory
    from accel.comm.collectives import broadcast as broadcast
    from accel.comm.collectives import broadcast_object as broadcast_object
    from accel.comm.collectives import check_trigger as check_trigger
    from accel.comm.collectives import gather as gather
    from accel.comm.collectives import gather_object as gather_object
    from accel.comm.collectives import pad_across_processes as pad_across_processes
    from accel.comm.collectives import reduce as reduce
    from accel.comm.collectives import set_trigger as set_trigger
    from accel.comm.collectives import split_between_processes as split_between_processes
    from accel.comm.collectives import wait_for_everyone as wait_for_everyone
    from accel.comm.gating import get_logger as get_logger
    from accel.comm.gating import local_main_process_first as local_main_process_first
    from accel.comm.gating import main_process_first as main_process_first
    from accel.comm.gating import on_last_process as on_last_process
    from accel.comm.gating import on_local_main_process as on_local_main_process
    from accel.comm.gating import on_local_process as on_local_process
    from accel.comm.gating import on_main_process as on_main_process
    from accel.comm.gating import on_process as on_process
    from accel.comm.gating import print as print
    from accel.comm.metrics import gather_for_metrics as gather_for_metrics
    from accel.comm.uneven import join_uneven_inputs as join_uneven_inputs
    from accel.core.process_group import distributed as distributed
    from accel.core.seeding import set_seed as set_seed
    from accel.core.state import ProcessState as ProcessState
    from accel.core.state import state as state
    from accel.data import prepare_data_loader as prepare_data_loader
    from accel.data import skip_first_batches as skip_first_batches
    from accel.launch.notebook import debug_launcher as debug_launcher
    from accel.launch.notebook import notebook_launcher as notebook_launcher
    from accel.memory import find_executable_batch_size as find_executable_batch_size
    from accel.memory import free_memory as free_memory
    from accel.parallel.deepspeed.zero_init import init_partitioned as init_partitioned
    from accel.parallel.pipeline.outputs import pipeline_forward as pipeline_forward
    from accel.parallel.pipeline.step import pipeline_step as pipeline_step
    from accel.precision.casting import autocast as autocast
    from accel.preemption import stop_requested as stop_requested
    from accel.profiling import profile as profile
    from accel.progress_bar import progress as progress
    from accel.trackers import get_tracker as get_tracker
    from accel.trackers import log as log
    from accel.trackers import tracking as tracking
    from accel.training.accumulation import accumulate as accumulate
    from accel.training.accumulation import backward as backward
    from accel.training.accumulation import no_sync as no_sync
    from accel.training.accumulation import sync_gradients as sync_gradients
    from accel.training.accumulation import trigger_sync_in_backward as trigger_sync_in_backward
    from accel.training.local_sgd import LocalSGD as LocalSGD
    from accel.training.model import prepare_model as prepare_model
    from accel.training.model import unwrap_model as unwrap_model
    from accel.training.optim import clip_grad_norm_ as clip_grad_norm_
    from accel.training.optim import clip_grad_value_ as clip_grad_value_
    from accel.training.optim import optimizer_step_was_skipped as optimizer_step_was_skipped
    from accel.training.optim import prepare_optimizer as prepare_optimizer
    from accel.training.optim import unscale_gradients as unscale_gradients
    from accel.training.preparation import prepare as prepare
    from accel.training.scheduling import prepare_scheduler as prepare_scheduler
    from accel.weights import get_state_dict as get_state_dict
    from accel.weights import load as load
    from accel.weights import save as save
    from accel.weights import save_model as save_model


# Reached as attributes (`accel.big_model.dispatch_model` after a plain `import accel`),
# imported on first access. Every subpackage is listed (tests/unit/test_public_api.py checks).
_SUBMODULES = (
    "big_model", "checkpoint", "cli", "comm", "core", "data", "launch", "parallel", "precision",
    "testing", "trackers", "training", "weights",
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"accel.{name}")
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'accel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))

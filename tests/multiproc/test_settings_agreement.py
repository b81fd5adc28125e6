"""Ranks that disagree on their settings get a named ConfigError on every rank, not a hang.

Each rank gets its own values by branching on its rank inside the spawned body: a nested
``accel.distributed(...)`` (the block's settings, agreed when it is entered) or the
arguments of ``prepare_model`` (its pipeline plan and schedule, agreed before any stage is
built). The ``ACCEL_*`` variables ``accel launch`` gives the workers are agreed by the
outermost ``distributed()`` (a script that sets one per rank before entering it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import accel
from accel.errors import ConfigError
from accel.testing import run_distributed, run_script
from tests import pipeline_models as pm

HERE = Path(__file__).parent


def _error(call: Any, *args: Any, **kwargs: Any) -> str:
    try:
        call(*args, **kwargs)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _nested(**options: Any) -> None:
    with accel.distributed(**options):
        pass


def _pipeline_body() -> dict[str, str]:
    """Two pipeline stages: schedules, plans and microbatches that differ, then the block's
    mixed precision; a prepare that agrees still works after them."""
    rank = accel.state().rank
    said = {
        "schedule": _error(accel.prepare_model, pm.Stack(),
                           pp_schedule="1F1B" if rank == 0 else "GPipe"),
        "plan": _error(accel.prepare_model, pm.Stack(),
                       pp_plan=["layers.1"] if rank == 0 else ["layers.2"]),
        "microbatches": _error(accel.prepare_model, pm.Stack(), microbatches=2 + 2 * rank),
        "mixed_precision": _error(_nested, mixed_precision="bf16" if rank == 0 else "no"),
    }
    model = accel.prepare_model(pm.Stack(), pp_schedule="GPipe", pp_plan=["layers.2"])
    x, y = pm.data()
    loss = accel.pipeline_step(model, x[:8], y[:8], loss_fn=nn.functional.mse_loss)
    said["agreed step"] = "ran" if loss is None or torch.isfinite(loss).all() else "nan"
    return said


def test_pipeline_ranks_that_disagree_raise_on_every_rank() -> None:
    out = run_distributed(_pipeline_body, world_size=2, timeout=60, pp_size=2)
    assert out[0] == out[1]  # the same error on every rank
    said = out[0]
    assert "ranks disagree on pp_schedule: rank 0 '1F1B', rank 1 'GPipe'" in said["schedule"]
    assert "accel.prepare_model()" in said["schedule"]
    assert "pp_plan: rank 0 ['layers.1'], rank 1 ['layers.2']" in said["plan"]
    assert "microbatches: rank 0 2, rank 1 4" in said["microbatches"]
    assert "accel.distributed(): ranks disagree on mixed_precision: rank 0 'bf16', " \
        "rank 1 'no'" in said["mixed_precision"]
    assert said["agreed step"] == "ran"


def _three_ranks_body() -> dict[str, str]:
    """DDP on three ranks: accumulation and a DDP option that differ on some ranks only."""
    rank = accel.state().rank
    said = {
        "accumulation": _error(_nested, gradient_accumulation_steps=2 if rank == 0 else 1),
        "ddp option": _error(accel.prepare_model, nn.Linear(2, 2),
                             bucket_cap_mb=25.0 if rank < 2 else 1.0),
        "same": _error(_nested, gradient_accumulation_steps=2, find_unused_parameters=False),
    }
    said["prepared"] = type(accel.prepare_model(nn.Linear(2, 2))).__name__
    return said


def test_three_ranks_name_each_rank_value() -> None:
    out = run_distributed(_three_ranks_body, world_size=3, timeout=60)
    assert out[0] == out[1] == out[2]
    said = out[0]
    assert "gradient_accumulation_steps: rank 0 2, ranks 1-2 1" in said["accumulation"]
    assert "bucket_cap_mb: ranks 0-1 25.0, rank 2 1.0" in said["ddp option"]
    assert said["same"] == "no error"
    assert said["prepared"] == "DistributedDataParallel"


def test_accel_variables_that_differ_per_rank_are_named(tmp_path: Path) -> None:
    env = {"ACCEL_GRADIENT_ACCUMULATION_STEPS": None}
    result = run_script(HERE / "agreement_env_script.py", world_size=2, timeout=60,
                        cwd=tmp_path, env=env)
    for rank, out in enumerate(result.stdout):
        assert "accel.distributed(): ranks disagree on gradient_accumulation_steps: " \
            "rank 0 1, rank 1 3" in out, (rank, out, result.stderr[rank])
        assert "group left: True" in out
    same = run_script(HERE / "agreement_env_script.py", "same", world_size=2, timeout=60,
                      cwd=tmp_path, env=env)
    assert all("agreed: 3" in out for out in same.stdout), same.stdout


def _fsdp_body() -> dict[str, str]:
    """FSDP2: ranks given different sharding options (the block's, and prepare_model's) are
    named before any rank shards."""
    rank = accel.state().rank
    said = {
        "block": _error(_nested, reshard_after_forward=rank == 0),
        "prepare_model": _error(accel.prepare_model, nn.Linear(4, 4),
                                cpu_offload=rank == 1),
    }
    model = accel.prepare_model(nn.Linear(4, 4))  # agreeing ranks still shard
    said["agreed"] = type(model).__name__
    return said


def test_fsdp_ranks_that_disagree_raise_on_every_rank() -> None:
    out = run_distributed(_fsdp_body, world_size=2, timeout=60, strategy="fsdp")
    assert out[0] == out[1]
    said = out[0]
    assert "ranks disagree on reshard_after_forward: rank 0 True, rank 1 False" in said["block"]
    assert "accel.prepare_model()" in said["prepare_model"]
    assert "cpu_offload: rank 0 False, rank 1 True" in said["prepare_model"]
    assert said["agreed"].startswith("FSDP")

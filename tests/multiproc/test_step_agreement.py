"""Ranks fed different batches get a named error on every rank, not a gloo abort or the loss's
raw error: a pipeline's stages (``accel.pipeline_step``) and a context-parallel group (a
transformers model's prepared forward, ``shard_sequence``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

import accel
from accel.errors import AccelError
from accel.testing import run_distributed
from tests import pipeline_models as pm


def _said(call: Any) -> str:
    try:
        call()
    except AccelError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _pipeline_batches(schedule: str) -> dict[str, Any]:
    """Steps of a 2-stage pipeline where the ranks are given batches of different sizes."""
    model = accel.prepare_model(pm.Stack(), pp_plan="auto", pp_schedule=schedule)
    rank = accel.state().rank
    x, y = pm.data()
    mse = nn.functional.mse_loss

    def step(size: int, *, first: bool = True, last: bool = True) -> torch.Tensor:
        return accel.pipeline_step(model, x[:size] if first else None,
                                   y[:size] if last else None, loss_fn=mse)

    said = {"first step": _said(lambda: step((8, 4)[rank]))}  # before torch's shape inference
    good = [float(step(8))]  # the stages were not touched: they build now, for batches of 8
    said["bigger"] = _said(lambda: step((16, 8)[rank]))  # rank 0 would overrun rank 1's buffers
    said["smaller"] = _said(lambda: step((8, 5)[rank]))  # and does not split in 2 microbatches
    said["all other"] = _said(lambda: step(4))  # the same on every rank, not the first step's
    with torch.no_grad():
        said["eval"] = _said(lambda: step((8, 6)[rank]))
    # what a stage does not read may be left out: nothing to compare
    good.append(float(step(8, first=rank == 0, last=rank == 1)))
    good.append(float(step(8)))
    return {"said": said, "good": good}


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_pipeline_ranks_fed_different_batches_raise_alike(schedule: str) -> None:
    out = run_distributed(_pipeline_batches, schedule, world_size=2, timeout=60, pp_size=2)
    assert out[0]["said"] == out[1]["said"]  # every rank, the same error
    said = out[0]["said"]
    stages = ("[0, 3]", "[1, 2]") if schedule == "ZBVZeroBubble" else ("[0]", "[1]")
    for key, (zero, one) in {"first step": (8, 4), "bigger": (16, 8), "smaller": (8, 5),
                             "eval": (8, 6)}.items():
        assert said[key].startswith("CollectiveMismatchError: "), said[key]
        assert (f"rank 0 (stages {stages[0]}): inputs ({zero}, 4), labels ({zero}, 2); "
                f"rank 1 (stages {stages[1]}): inputs ({one}, 4), labels ({one}, 2)"
                ) in said[key]
        assert "`accel.prepare_data_loader(loader)`" in said[key]
    assert said["all other"].startswith("ConfigError: pipeline_step: this step's inputs have "
                                        "the shape (4, 4) on every rank, but the pipeline's "
                                        "stages were built on its first step for (8, 4)")
    assert all(torch.isfinite(torch.tensor(o["good"])).all() for o in out)
    assert out[0]["good"] == out[1]["good"]


def _cp_batches() -> dict[str, str]:
    """Forwards of a cp2 Llama and plain ``shard_sequence`` calls with different batches."""
    from accel.parallel.context_parallel import shard_sequence
    from tests import cp_models as cm

    model = accel.prepare_model(cm.llama())
    rank = accel.state().rank
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def forward(batch: int, length: int) -> None:
        piece = ids[:batch, :length]
        accel.backward(model(input_ids=piece, labels=piece).loss)

    said = {"length": _said(lambda: forward(2, (12, 8)[rank])),  # gloo aborted in attention
            "batch": _said(lambda: forward((2, 1)[rank], 12)),
            "same": _said(lambda: forward(2, 12)),
            "shard length": _said(lambda: shard_sequence({"input_ids": ids[:, :(12, 8)[rank]]})),
            "shard odd": _said(lambda: shard_sequence({"input_ids": ids[:, :(12, 13)[rank]]})),
            "shard embeds": _said(lambda: shard_sequence(
                {"inputs_embeds": torch.zeros(2, 8, (4, 6)[rank])})),
            "one mask": _said(lambda: shard_sequence(
                {"input_ids": ids[:, :8], "attention_mask": torch.ones(2, 8).tril()[:2] if rank
                 else torch.ones(2, 8)})),
            "after": _said(lambda: forward(2, 8))}
    return said


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers not installed")
@pytest.mark.preload("transformers", "transformers.models.llama.modeling_llama")
def test_cp_ranks_given_different_batches_raise_alike() -> None:
    out = run_distributed(_cp_batches, world_size=2, timeout=60, cp_size=2)
    assert out[0] == out[1]  # every rank, the same error
    said = out[0]
    for key, (zero, one) in {"length": ("input_ids (2, 12)", "input_ids (2, 8)"),
                             "batch": ("input_ids (2, 12)", "input_ids (1, 12)"),
                             "shard length": ("input_ids (2, 12)", "input_ids (2, 8)"),
                             "shard odd": ("input_ids (2, 12)", "input_ids (2, 13)"),
                             "shard embeds": ("inputs_embeds (2, 8, 4)",
                                              "inputs_embeds (2, 8, 6)")}.items():
        assert said[key] == (
            "CollectiveMismatchError: Context parallelism: the ranks of one cp group were "
            f"given batches of different shapes (rank 0: {zero}; rank 1: {one}); each keeps "
            "its piece of every sequence of the SAME batch, and attention exchanges the "
            "pieces. Give every rank of a cp group the same batches (e.g. through "
            "`accel.prepare_data_loader(loader)`, which shards by the data-parallel rank "
            "only), padded to one length."), key
    assert said["one mask"].startswith("ConfigError: Context parallelism takes no padding mask")
    assert said["same"] == said["after"] == "no error"

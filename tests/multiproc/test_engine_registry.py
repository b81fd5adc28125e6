"""A new engine is one unit plus one registry line: a test-only engine, registered from here,
trains the quicktour loop on 2 processes equal to DDP.

``HandAveraged`` is a minimal data-parallel engine: the model is left unwrapped and each
parameter's gradient is all-reduced and averaged by a post-accumulate hook on sync steps. It
touches nothing of accel's but :class:`~accel.parallel.engines.base.Engine` and
:func:`~accel.parallel.engines.registry.register_engine`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accel
from accel.core.state import ProcessState
from accel.errors import ConfigError
from accel.parallel.engines.base import Engine, Placed
from accel.parallel.engines.registry import ENGINES, engine_for, register_engine
from accel.testing import run_distributed


def _average(param: torch.Tensor) -> None:
    if accel.sync_gradients() and param.grad is not None:
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()


@attrs.frozen
class HandAveraged(Engine):
    """Data parallelism by hand: gradients averaged over the ranks on each sync step."""

    name: ClassVar[str] = "hand_averaged"

    def wrap(self, placed: Placed, st: ProcessState, evaluation_mode: bool) -> nn.Module:
        if st.world_size > 1 and not evaluation_mode:
            for param in placed.model.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(_average)
        return placed.model


register_engine(HandAveraged())  # the one registry line (idempotent: workers import us too)


def _quicktour(strategy: str) -> tuple[dict[str, torch.Tensor], float, type]:
    """The quicktour loop (prepare, autocast, backward, clipping, scheduler, accumulation,
    gather_for_metrics) under ``strategy``; the trained weights, the last accuracy, the type
    of the prepared model."""
    with accel.distributed(strategy=strategy, gradient_accumulation_steps=2, seed=42):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(96, 10, generator=g)
        y = (x @ torch.randn(10, 5, generator=g)).argmax(-1)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
        model, optimizer, loader, scheduler = accel.prepare(model, optimizer, loader, scheduler)
        accuracy = 0.0
        for _ in range(2):
            hits = []
            for xb, yb in loader:
                with accel.accumulate(model):
                    with accel.autocast():
                        logits = model(xb)
                        loss = nn.functional.cross_entropy(logits, yb)
                    accel.backward(loss)
                    accel.clip_grad_norm_(model.parameters(), max_norm=1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                preds, targets = accel.gather_for_metrics((logits.argmax(-1), yb))
                hits.append((preds == targets).float())
            accuracy = torch.cat(hits).mean().item()
        weights = {k: v.detach().clone() for k, v in accel.unwrap_model(model).state_dict().items()}
        return weights, accuracy, type(model)


def _both() -> dict[str, Any]:
    ours, our_accuracy, our_type = _quicktour("hand_averaged")
    ddp, ddp_accuracy, ddp_type = _quicktour("ddp")
    return {
        "diff": max((ours[k] - ddp[k]).abs().max().item() for k in ddp),
        "accuracy": (our_accuracy, ddp_accuracy),
        "types": (our_type.__name__, ddp_type.__name__),
        "strategy": accel.state().strategy,
    }


def test_a_registered_engine_trains_the_quicktour_loop_equal_to_ddp() -> None:
    results = run_distributed(_both, world_size=2, strategy="hand_averaged")
    for result in results:
        assert result["strategy"] == "hand_averaged"  # chosen once by distributed()
        assert result["types"] == ("Sequential", "DistributedDataParallel")
        assert result["diff"] < 1e-5, result
        assert result["accuracy"][0] == pytest.approx(result["accuracy"][1])
    assert results[0]["diff"] == results[1]["diff"]  # the ranks agree


def test_the_registry_names_its_engines_and_refuses_a_second_unit_under_a_name() -> None:
    assert isinstance(engine_for("hand_averaged"), HandAveraged)
    assert list(ENGINES)[:4] == ["none", "ddp", "fsdp", "deepspeed"]

    @attrs.frozen
    class Impostor(Engine):
        name: ClassVar[str] = "ddp"

    with pytest.raises(ConfigError, match="'ddp' is already the engine of DDP"):
        register_engine(Impostor())
    with pytest.raises(ConfigError, match=r"strategy='toy' is not supported; choose one of \["):
        engine_for("toy")
    with accel.distributed(strategy="hand_averaged") as st:
        assert st.strategy == "hand_averaged"
        model = accel.prepare_model(nn.Linear(2, 2))
        assert type(model) is nn.Linear  # one process: nothing to average

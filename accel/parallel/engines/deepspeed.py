"""The DeepSpeed engine (``strategy="deepspeed"``): ZeRO 1-3 through ``deepspeed.initialize``.

The unit hands the loop's calls to the engine that ``accel.prepare`` built (the machinery
lives in ``accel.parallel.deepspeed``, which imports DeepSpeed only when a model is
prepared): DeepSpeed's engine divides the loss by the accumulation steps, scales fp16, steps,
clips and zeroes the gradients itself.

Example:
    >>> with accel.distributed(strategy="deepspeed", zero_stage=2):
    ...     model, optimizer, loader = accel.prepare(model, optimizer, loader)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from accel.core.state import ProcessState
from accel.errors import ConfigError
from accel.parallel.engines.base import Engine
from accel.precision.base import Layouts, StepRecord

__all__ = ["DeepSpeed"]


@attrs.frozen
class DeepSpeed(Engine):
    """``strategy="deepspeed"``: the model and its optimizer prepared together into
    DeepSpeed's engine, which every training call then goes through.

    Example:
        >>> engine_for("deepspeed").optimizer_scaler(accel.state()) is None
        True
    """

    name: ClassVar[str] = "deepspeed"

    def prepare(
        self, objects: tuple[Any, ...], prepare_one: Callable[[Any], Any],
        mark: Callable[[nn.Module, nn.Module], None],
    ) -> list[Any]:
        """Loaders first (their batch size fills the config), then the model and its
        optimizer through ``deepspeed.initialize``; the model comes back as the engine, the
        optimizer prepared as usual (its ``step`` is the engine's), schedulers too."""
        from accel.parallel.deepspeed.engine import initialize

        models = [obj for obj in objects if isinstance(obj, nn.Module)]
        optimizers = [obj for obj in objects if isinstance(obj, torch.optim.Optimizer)]
        if len(models) != 1 or len(optimizers) > 1:
            raise ConfigError(
                f"strategy='deepspeed' prepares one model with at most one optimizer per "
                f"accel.prepare call, got {len(models)} model(s) and {len(optimizers)} "
                "optimizer(s). Wrap several models in one nn.Module, e.g. "
                "`model, optimizer, loader = accel.prepare(model, optimizer, loader)`."
            )
        results: list[Any] = [
            obj if isinstance(obj, nn.Module | torch.optim.Optimizer | LRScheduler)
            else prepare_one(obj) for obj in objects
        ]
        user_optimizer = (getattr(optimizers[0], "optimizer", optimizers[0]) if optimizers
                          else None)
        loaders = [r for r in results if hasattr(r, "total_batch_size")]
        schedulers = [obj for obj in objects if isinstance(obj, LRScheduler)]
        run = initialize(models[0], user_optimizer, loaders,
                         schedulers[0] if schedulers else None)
        mark(models[0], run.engine)
        mark(run.engine, run.engine)
        for index, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                results[index] = run.engine
            elif isinstance(obj, torch.optim.Optimizer | LRScheduler):
                results[index] = prepare_one(obj)
        return results

    def refuse_prepare_model(self) -> None:
        from accel.parallel.deepspeed.engine import refuse

        raise refuse("accel.prepare_model(model) on its own")

    def inner(self, model: nn.Module) -> nn.Module | None:
        if "deepspeed" not in sys.modules:  # no engine was ever made in this process
            return None
        from accel.parallel.deepspeed.engine import inner_module

        return inner_module(model)

    def backward(self, loss: torch.Tensor, st: ProcessState, kwargs: dict[str, Any]) -> None:
        from accel.parallel.deepspeed.engine import backward as engine_backward

        engine_backward(loss, **kwargs)  # the engine divides by the steps and scales fp16

    def optimizer_scaler(self, st: ProcessState) -> torch.amp.GradScaler | None:
        return None  # the engine scales fp16 losses itself

    def step(
        self, record: StepRecord, closure: Callable[[], float] | None, st: ProcessState,
        sync: bool, layouts: Layouts,
    ) -> Any:
        from accel.parallel.deepspeed.engine import step as engine_step

        engine_step(record)  # every micro-step: the engine counts them
        return None

    def zero_grad(self, optimizer: Any, set_to_none: bool | None, sync: bool) -> None:
        return  # the engine zeroes the gradients in its step

    def clip_grad_norm(
        self, params: list[Any], max_norm: float, norm_type: float, sync: bool,
        unscale: Callable[[], None],
    ) -> torch.Tensor:
        from accel.parallel.deepspeed.engine import clip_grad_norm

        return clip_grad_norm(max_norm, norm_type)  # the engine clips inside its step

    def clip_grad_value(
        self, params: list[Any], clip_value: float, sync: bool, unscale: Callable[[], None]
    ) -> None:
        from accel.parallel.deepspeed.engine import refuse

        raise refuse("accel.clip_grad_value_ (DeepSpeed clips the norm: gradient_clipping)")

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        if "deepspeed" not in sys.modules:
            return None
        from accel.parallel.deepspeed.weights import gathered_state_dict, is_partitioned

        # ZeRO-3: each parameter gathered from its partitions
        return gathered_state_dict(module) if is_partitioned(module) else None

    def checkpoint_objects(self, objects: dict[str, Any], *, gather: bool) -> dict[str, Any]:
        from accel.parallel.deepspeed.checkpoint import plain_objects

        # the engine's state by parameter name (gather: collectives, every rank, in order)
        return plain_objects(objects, gather=gather)

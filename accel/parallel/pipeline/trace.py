"""One tiny forward of the whole model, before it is split, to learn what the split relies on:
the order in which the forward calls its modules, and which modules return a tuple.

A split keeps the model's own ``forward`` and replaces other stages' modules by pass-throughs,
so it needs the order the forward reaches the modules (registration order is not always it:
OPT registers its final layer norm before its layers) and each replaced module's output
structure (a Bloom or Falcon block returns a tuple whose ``[0]`` the forward reads). Both are
read from one forward of a transformers causal model on a ``(1, 2)`` batch of token ids, under
``no_grad``; a model that cannot be run that way (another input, weights on the meta device)
is not traced and keeps registration order and single-tensor pass-throughs.

Example:
    >>> trace = trace_forward(opt_model)
    >>> trace.rank["model.decoder.final_layer_norm"] > trace.rank["model.decoder.layers.1"]
    True
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

__all__ = ["ForwardTrace", "trace_forward"]


@attrs.frozen
class ForwardTrace:
    """What one forward of the whole model showed.

    Example:
        >>> ForwardTrace(rank={"embed": 0, "head": 1}, tuples={}).rank["head"]
        1
    """

    rank: Mapping[str, int]
    """Module name -> the position of its first call in the forward."""
    tuples: Mapping[str, int]
    """Module name -> the length of the tuple it returned (modules returning a tuple only)."""


def _inputs(model: nn.Module) -> dict[str, Any] | None:
    """A ``(1, 2)`` batch of token ids for a transformers model that takes ``input_ids``."""
    config = getattr(model, "config", None)
    if config is None or getattr(model, "main_input_name", None) != "input_ids":
        return None
    if getattr(config, "is_encoder_decoder", False):
        return None
    try:
        names = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    if "input_ids" not in names:
        return None
    first = next(model.parameters(), None)
    if first is None or first.device.type == "meta":
        return None
    inputs: dict[str, Any] = {
        "input_ids": torch.zeros((1, 2), dtype=torch.long, device=first.device)}
    if "use_cache" in names:
        inputs["use_cache"] = False
    return inputs


def trace_forward(model: nn.Module) -> ForwardTrace | None:
    """The call order and tuple outputs of ``model``'s modules in one tiny forward, or
    ``None`` when the model cannot be run on token ids here (see the module's docstring).

    Example:
        >>> trace_forward(nn.Linear(2, 2)) is None  # not a transformers model
        True
    """
    inputs = _inputs(model)
    if inputs is None:
        return None
    rank: dict[str, int] = {}
    tuples: dict[str, int] = {}
    handles = []

    def watch(name: str) -> Any:
        def before(module: nn.Module, args: Any) -> None:
            rank.setdefault(name, len(rank))

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if type(output) is tuple:
                tuples.setdefault(name, len(output))

        return before, after

    for name, module in model.named_modules():
        if name:
            before, after = watch(name)
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after))
    modes = {module: module.training for module in model.modules()}
    devices = [] if inputs["input_ids"].device.type == "cpu" else [inputs["input_ids"].device]
    try:
        model.eval()  # no dropout; the structure of the outputs is the same
        # nothing of the run's random streams is drawn (one process and a split one agree)
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model(**inputs)
    except Exception:  # a model this tiny batch does not fit: registration order is used
        return None
    finally:
        for module, training in modes.items():
            module.training = training
        for handle in handles:
            handle.remove()
    return ForwardTrace(rank=rank, tuples=tuples)

"""Check that a saved state fits an object before anything is loaded into it.

``load_state`` calls :func:`check_fits` for every object first, so a checkpoint of another
model (wrong keys or shapes) or of an optimizer over other parameters, or values of another
type than the live object holds (:mod:`accel._files.values`), fail before any object
changes. Objects accel knows nothing about are checked by their own ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accel._files.values import PARAM_SHAPED, check_values
from accel.errors import CheckpointError

__all__ = ["check_fits"]


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _check_module(name: str, module: nn.Module, saved: Any) -> None:
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"The checkpoint's {name!r} is not a module state dict.")
    own = module.state_dict()
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"The checkpoint's {name!r} does not match the model passed as {name}=: missing "
            f"keys {missing[:8]}, unexpected keys {unexpected[:8]}. Pass the model the "
            "checkpoint was saved from (same architecture), under the same name."
        )
    wrong = [
        f"{key}: checkpoint {_shape(saved[key])}, model {_shape(value)}"
        for key, value in own.items()
        if _shape(value) is not None and _shape(saved[key]) != _shape(value)
    ]
    if wrong:
        raise CheckpointError(
            f"The checkpoint's {name!r} has other shapes than the model passed as {name}=: "
            f"{'; '.join(wrong[:8])}. Build the model with the configuration it was saved with."
        )


def _check_optimizer(name: str, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    state = saved.get("state") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        raise CheckpointError(f"The checkpoint's {name!r} is not an optimizer state dict.")
    own = optimizer.param_groups
    saved_sizes = [len(g.get("params", ())) if isinstance(g, Mapping) else -1 for g in groups]
    own_sizes = [len(g["params"]) for g in own]
    if saved_sizes != own_sizes:
        raise CheckpointError(
            f"The checkpoint's optimizer {name!r} has parameter groups of sizes {saved_sizes}, "
            f"the optimizer passed as {name}= has {own_sizes}. Create the optimizer over the "
            "same parameters, in the same groups, as when it was saved."
        )
    _check_ids(name, [i for g in groups for i in g["params"]], state)
    for saved_group, own_group in zip(groups, own, strict=True):
        for index, param in zip(saved_group["params"], own_group["params"], strict=True):
            entry = state.get(index)
            if not isinstance(entry, Mapping):
                continue
            for key, value in entry.items():
                shape = _shape(value)
                if key in PARAM_SHAPED and shape is not None and shape != tuple(param.shape):
                    raise CheckpointError(
                        f"The checkpoint's optimizer {name!r} holds {key!r} of shape {shape} "
                        f"for a parameter of shape {tuple(param.shape)}: it was saved for "
                        "another model. Load the matching checkpoint."
                    )


def _check_ids(name: str, ids: list[Any], state: Mapping[Any, Any]) -> None:
    """The parameter ids of the groups are distinct numbers (or names), and every numbered
    per-parameter state belongs to one of them: else ``load_state_dict`` would give a
    parameter another's state, or silently drop it."""
    plain = all(isinstance(i, int | str) and not isinstance(i, bool) for i in ids)
    if not plain or len(set(ids)) != len(ids):
        raise CheckpointError(
            f"The checkpoint's optimizer {name!r} names its parameters {ids[:8]!r:.200}: each "
            "must be a distinct number (torch writes 0, 1, 2, ...). The checkpoint is corrupted "
            "or crafted; load an earlier one."
        )
    known = set(ids)
    stray = [k for k in state if isinstance(k, int) and not isinstance(k, bool) and k not in known]
    if stray:
        raise CheckpointError(
            f"The checkpoint's optimizer {name!r} holds state for parameters {stray[:8]!r:.200} "
            f"that none of its parameter groups names (they name {ids[:8]!r:.200}): loading "
            "would drop it. The checkpoint is corrupted or crafted; load an earlier one."
        )


def check_fits(name: str, target: Any, saved: Any) -> None:
    """Raise :class:`CheckpointError` if ``saved`` cannot load into ``target`` (unwrapped).

    Example:
        >>> check_fits("model", nn.Linear(2, 2), nn.Linear(3, 3).state_dict())
        Traceback (most recent call last):
        accel.errors.CheckpointError: The checkpoint's 'model' has other shapes ...
    """
    if isinstance(target, nn.Module):
        _check_module(name, target, saved)
    elif isinstance(target, torch.optim.Optimizer):
        _check_optimizer(name, target, saved)
    check_values(name, target, saved)  # types, finiteness and dtype kinds of the values

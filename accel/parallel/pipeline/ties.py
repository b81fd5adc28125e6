"""Parameters tied across pipeline stages: one tensor of the model used by two stages.

An LM head tied to the token embedding (GPT-2, any transformers model with
``tie_word_embeddings=True``) puts one parameter on the first stage and the last. As Megatron
does with its embedding group, every pipeline rank whose stages use the parameter keeps a copy
of it: at ``prepare_model`` the copies are made equal (broadcast from the rank holding the
stage that names it first, its *owner*), and after each step's backward (on the step that ends
an accumulation cycle) their gradients are summed over exactly those ranks, one all-reduce per
tie over a process group made once, at prepare time, for each coordinate of the other mesh
dims. So every copy gets the gradient one process computes and the optimizer keeps them equal.
A rank holding several of the stages (the V schedules: the first and last stage on rank 0)
shares one parameter between them, as the model does.

The gradient norm counts each tie once (on its owner's rank, see :func:`is_copy`).

Example:
    >>> ties = find_ties(gpt2, plan)
    >>> ties[0].names
    ('transformer.wte.weight', 'lm_head.weight')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from accel.parallel.pipeline.split import StagePlan

__all__ = ["Tie", "find_ties", "is_copy", "link_ties", "mark_copies", "sync_tied_grads"]

_COPY = "_accel_pp_tie_copy"  # attribute of a tied parameter on a rank that does not own it


@attrs.define(eq=False)
class Tie:
    """One parameter used by several stages: its names, stages and this rank's copy."""

    names: tuple[str, ...]
    """Every name of the parameter in the unsplit model (the first is its owner's)."""
    stages: tuple[int, ...]
    """The stage of each name."""
    local: str | None = None
    """The name this rank's stages hold it under (``None``: none of them uses it)."""
    owner_here: bool = False
    group: Any = None
    """The process group of the ranks holding it at this rank's other coordinates."""
    src: int = 0
    """The owner's rank within :attr:`group`."""


def find_ties(model: nn.Module, plan: StagePlan) -> list[Tie]:
    """The parameters of ``model`` (unsplit) that units of two stages or more use.

    Example:
        >>> [t.stages for t in find_ties(gpt2, stage_plan(gpt2, ["transformer.h.1"]))]
        [(0, 1)]
    """
    stage_of = plan.stage_of
    seen: dict[int, list[tuple[str, int]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        unit = next((u for u in plan.units if name.startswith(u + ".")), None)
        if unit is not None:
            seen.setdefault(id(param), []).append((name, stage_of[unit]))
    return [Tie(tuple(n for n, _ in uses), tuple(s for _, s in uses))
            for uses in seen.values() if len({s for _, s in uses}) > 1]


def link_ties(ties: Sequence[Tie], model: nn.Module, holders: Sequence[Sequence[int]],
              local: Sequence[int]) -> None:
    """Make the process groups of ``ties`` (every rank, the same order) and equal their copies.

    ``holders[r]`` are the stages pipeline rank ``r`` holds; ``local`` this rank's. Call it
    after the split and the move to the device, before any sharding.
    """
    import torch.distributed as dist

    from accel.core.state import state

    mesh = state().mesh
    grid = mesh.mesh.reshape(len(holders), -1).tolist()  # pp x (every other coordinate)
    me = dist.get_rank()
    for tie in ties:
        ranks = [r for r, stages in enumerate(holders) if set(stages) & set(tie.stages)]
        owner = next(r for r, stages in enumerate(holders) if tie.stages[0] in stages)
        tie.local = next((n for n, s in zip(tie.names, tie.stages, strict=True) if s in local),
                         None)
        tie.owner_here = tie.stages[0] in local
        if len(ranks) < 2:
            continue  # one rank holds every stage using it: the model's own tie
        for column in range(len(grid[0])):
            members = [int(grid[r][column]) for r in ranks]
            group = dist.new_group(members)
            if me in members:
                tie.group, tie.src = group, ranks.index(owner)
        if tie.local is not None and tie.group is not None:
            param = model.get_parameter(tie.local)
            with torch.no_grad():
                dist.broadcast(param.data, group=tie.group, group_src=tie.src)


def mark_copies(ties: Sequence[Tie], model: nn.Module) -> None:
    """Mark this rank's copies of ties it does not own (their parameters as they are now,
    after any sharding), so the gradient norm counts each tie once."""
    for tie in ties:
        if tie.local is not None and not tie.owner_here:
            setattr(model.get_parameter(tie.local), _COPY, True)


def is_copy(param: object) -> bool:
    """Whether ``param`` is a tied parameter's copy another rank owns (left out of norms).

    Example:
        >>> is_copy(stage1_model.lm_head.weight)   # GPT-2 on PP2: the embedding's copy
        True
    """
    return bool(getattr(param, _COPY, False))


def sync_tied_grads(ties: Sequence[Tie], model: nn.Module) -> None:
    """Sum each tie's gradients over the ranks holding it (every member, the same order).

    A copy without a gradient takes part with zeros (and keeps them as its gradient).
    """
    import torch.distributed as dist

    for tie in ties:
        if tie.group is None or tie.local is None:
            continue
        param = model.get_parameter(tie.local)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        placements = getattr(param, "placements", None)
        if placements is not None and tuple(getattr(grad, "placements", placements)) != tuple(
                placements):  # TP's vocab-parallel embedding leaves a replicated gradient
            grad = param.grad = grad.redistribute(  # type: ignore[attr-defined]
                param.device_mesh, placements)  # type: ignore[attr-defined]
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=tie.group)

"""Tied tensors in ``save_state`` checkpoints: one entry per tensor, under its first name.

A tensor reachable under several names of a model (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``; a module registered twice) is stored once, under the first name its
model's ``state_dict()`` gives it, which is also the name torch's
``get_optimizer_state_dict`` keys its optimizer state by. The other names are recorded in the
object's ``extra["tied"]`` as ``{alias: stored name}``.

Loading accepts the tensor under whichever of its names the target model knows: the names tied
in the checkpoint and the names tied in the target are one group, and a target name missing
from the checkpoint takes the value stored under another name of its group. So a checkpoint
loads into a model tied the same way, a model whose tie is made only after loading (both names
get the same values), a model whose first name differs, and from older checkpoints that stored
every name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

__all__ = [
    "PARAM_NAMES", "TIED", "Names", "by_names", "match_names", "names_by_param",
    "optimizer_names", "owner", "saved_ties", "split_ties", "tie_map", "untie",
]

TIED = "tied"  # the ``extra`` entry of a model or optimizer: {alias: stored name}
PARAM_NAMES = "param_names"  # a position-keyed optimizer's parameter names, group by group


def tie_map(module: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for every ``state_dict`` name bound to a tensor named before
    (for a pipelined model: also the names tied across its stages, held here or not).

    Example:
        >>> lm.head.weight = lm.embed.weight
        >>> tie_map(lm)
        {'head.weight': 'embed.weight'}
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        key = id(value)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    for alias, name in _stage_ties(module).items():
        aliases.setdefault(alias, name)
    return aliases


def _stage_ties(module: nn.Module) -> dict[str, str]:
    """A pipelined model's ties across stages (``{alias: first name}`` of the unsplit model),
    whichever names this rank's stages hold."""
    from accel.parallel.pipeline.stages import pipeline_of

    pipe = pipeline_of(module)
    if pipe is None:
        return {}
    return {alias: tie.names[0] for tie in pipe.ties for alias in tie.names[1:]}


def split_ties(
    module: nn.Module, state: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """``state`` (the module's ``state_dict()``) without aliases, and the aliases dropped."""
    aliases = tie_map(module)
    return {k: v for k, v in state.items() if k not in aliases}, aliases


class Names:
    """Groups of names bound to one tensor, from a checkpoint's ties and a model's ties."""

    def __init__(self, *ties: Mapping[str, str]) -> None:
        self._parent: dict[str, str] = {}
        for mapping in ties:
            for alias, name in mapping.items():
                self._join(str(alias), str(name))

    def group(self, name: str) -> str:
        """A representative of ``name``'s group (``name`` itself when it is in none)."""
        root = name
        while self._parent.get(root, root) != root:
            root = self._parent[root]
        while name != root:  # shorten the path for later look-ups
            self._parent[name], name = root, self._parent[name]
        return root

    def _join(self, a: str, b: str) -> None:
        ra, rb = self.group(a), self.group(b)
        if ra != rb:
            self._parent[ra] = rb
            self._parent.setdefault(rb, rb)


def saved_ties(extra: Mapping[str, Any]) -> dict[str, str]:
    """The checkpoint's ``{alias: stored name}`` of one object (``{}`` when none)."""
    found = extra.get(TIED)
    if not isinstance(found, Mapping):
        return {}
    return {str(k): str(v) for k, v in found.items() if isinstance(v, str)}


def untie(module: nn.Module, saved: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` with exactly the names ``module.state_dict()`` has, where ties allow.

    A name of the module missing from ``saved`` takes the value stored under another name of
    its group; a stored name the module lacks is dropped when the module holds another name
    of its group. Names that fit no group are left for the key check to report.
    """
    own = list(module.state_dict(keep_vars=True))
    names = Names(saved_ties(extra), tie_map(module))
    stored: dict[str, str] = {}
    for key in saved:
        stored.setdefault(names.group(key), key)
    out = dict(saved)
    own_set = set(own)
    for key in own:
        if key not in out:
            source = stored.get(names.group(key))
            if source is not None:
                out[key] = saved[source]
    known = {names.group(k) for k in own}
    for key in list(out):
        if key not in own_set and names.group(key) in known:
            del out[key]
    return out


def names_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter (``id`` -> names, first name first)."""
    found: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), []).append(name)
    return found


def match_names(
    saved_ids: Iterable[Any], params: Iterable[Any], model: nn.Module, extra: Mapping[str, Any]
) -> list[str | None]:
    """For each of ``params``, the saved name its state is under (``None`` when none is).

    Saved names are matched through the groups of the checkpoint's and the model's ties, so
    a parameter saved under its first name matches whichever name the model gives it first.
    """
    names = Names(saved_ties(extra), tie_map(model))
    by_group: dict[str, str] = {}
    for saved in saved_ids:
        by_group.setdefault(names.group(str(saved)), str(saved))
    all_names = names_by_param(model)
    out: list[str | None] = []
    for param in params:
        hit = None
        for name in all_names.get(id(param), []):
            hit = by_group.get(names.group(name))
            if hit is not None:
                break
        out.append(hit)
    return out


def _params(optimizer: Any) -> list[list[Any]] | None:
    groups = getattr(getattr(optimizer, "optimizer", optimizer), "param_groups", None)
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        return None
    return [list(g.get("params", [])) for g in groups]


def owner(optimizer: Any, objects: Mapping[str, Any]) -> nn.Module | None:
    """The first model among ``objects`` holding every parameter of ``optimizer``, if any."""
    from accel.training.model import unwrap_model

    groups = _params(optimizer)
    if not groups:
        return None
    wanted = {id(p) for group in groups for p in group}
    for obj in objects.values():
        if isinstance(obj, nn.Module):
            module = unwrap_model(obj)
            if wanted <= {id(p) for p in module.parameters()}:
                return module
    return None


def optimizer_names(optimizer: Any, objects: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` of a position-keyed optimizer: its parameters' first names and the ties.

    ``{}`` when no model passed alongside holds all of its parameters (it then loads by
    position only).
    """
    model = owner(optimizer, objects)
    groups = _params(optimizer)
    if model is None or groups is None:
        return {}
    first = names_by_param(model)
    extra: dict[str, Any] = {PARAM_NAMES: [[first[id(p)][0] for p in g] for g in groups]}
    tied = tie_map(model)
    if tied:
        extra[TIED] = tied
    return extra


def by_names(saved: Any, extra: Mapping[str, Any]) -> Any:
    """A position-keyed optimizer state re-keyed by the parameter names saved with it.

    Returns ``None`` when the names do not describe ``saved`` (left for the checks to report).
    """
    names = extra.get(PARAM_NAMES)
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    state = saved.get("state") if isinstance(saved, Mapping) else None
    if not (isinstance(names, list) and isinstance(groups, list)
            and isinstance(state, Mapping) and len(names) == len(groups)):
        return None
    new_state: dict[str, Any] = {}
    new_groups = []
    seen: set[Any] = set()
    for group, group_names in zip(groups, names, strict=True):
        ids = group.get("params") if isinstance(group, Mapping) else None
        if not (isinstance(ids, list) and isinstance(group_names, list)
                and len(ids) == len(group_names)
                and all(isinstance(n, str) for n in group_names)):
            return None
        for pid, param_name in zip(ids, group_names, strict=True):
            if not isinstance(pid, int | str) or pid in seen:
                return None  # ids torch never writes: left for the checks to report
            seen.add(pid)
            if pid in state:
                new_state[param_name] = state[pid]
        new_groups.append({**group, "params": list(group_names)})
    if any(isinstance(k, int) and k not in seen for k in state):
        return None  # state that no group names would be dropped: left for the checks
    return {**saved, "state": new_state, "param_groups": new_groups}

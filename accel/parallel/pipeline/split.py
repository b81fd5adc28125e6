"""Split a model into pipeline stages by module name, without copying a weight.

A plan names the modules that start a new stage (torch's ``SplitPoint.BEGINNING``):
``["layers.4", "layers.8"]`` makes three stages. The model is seen as a chain of *units*: the
children of the root and, along the path to each split point, the children of the modules
that path crosses (for ``"model.layers.4"``: ``model.embed_tokens``, ``model.layers.0`` ...,
``model.norm``, ``model.rotary_emb``, ``lm_head``), in the order the forward calls them (from
one traced forward of a transformers model, :mod:`~accel.parallel.pipeline.trace`; else the
order they were registered in, which must then be the forward's). Each stage keeps its units;
the others are replaced by a :class:`PassThrough` that hands its first input on (in a tuple
where the unit returned one), so the model's own ``forward`` runs the stage (torchtitan's
manual split, without the deep copy); the previous stage's last unit becomes a
:class:`Handoff` that gives the stage's first unit exactly what the previous stage sent. A
unit without parameters but with buffers (a rotary embedding's frequencies) is a helper every
stage keeps; one with neither (an activation, a dropout) is placed by its position like the
others.

``int`` plans and ``"auto"`` split the model's blocks (its ``_no_split_modules`` classes, else
the children of its largest ``nn.ModuleList``/``nn.Sequential``) evenly: what comes before the
first block (the embeddings) stays with the first stage, what comes after the last (the final
norm and the head) with the last.

Example:
    >>> plan = stage_plan(net, ["layers.2"])
    >>> plan.num_stages, plan.units_of(1)
    (2, ('layers.2', 'layers.3', 'head'))
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from accel.errors import ConfigError
from accel.parallel.blocks import declared_blocks
from accel.parallel.pipeline.trace import ForwardTrace

__all__ = ["Exit", "Handoff", "Inbox", "NoEmbedding", "PassThrough", "StageExit", "StagePlan",
           "block_names", "crossed_modules", "keep_stages", "split_points", "stage_plan",
           "stage_view"]

SHARED = -1
"""The stage number of a unit every stage keeps (buffers, no parameters)."""


class NoEmbedding(nn.Module):
    """Stands where an earlier stage's embedding was in a stage fed ``inputs_embeds=``: the
    forward then calls it only for what it adds to the embeddings (GPT-2's positions), which
    the earlier stage already added, so it adds nothing.

    Example:
        >>> NoEmbedding()(position_ids)
        tensor(0.)
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """A zero (0-d: it broadcasts and keeps the other operand's dtype)."""
        return torch.zeros(())


class PassThrough(nn.Module):
    """Stands where another stage's module was: returns its first input unchanged (as the
    first item of a tuple of ``width`` items when the module it stands for returned a tuple:
    a Bloom or Falcon block, whose ``[0]`` the forward reads).

    Example:
        >>> PassThrough()(x, attention_mask=None) is x
        True
        >>> PassThrough(width=2)(x)[1] is None
        True
    """

    def __init__(self, width: int = 0) -> None:
        super().__init__()
        self.width = width

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first positional argument, else the first keyword argument's value."""
        first = args[0] if args else next(iter(kwargs.values()), None)
        return self._shaped(first)

    def _shaped(self, value: Any) -> Any:
        if self.width:
            return (value, *(None,) * (self.width - 1))
        return value


class StageExit(BaseException):
    """Ends a stage's forward where the next stage begins, carrying the stage's output (a
    ``BaseException`` so that no ``except Exception`` in a model's forward swallows it).

    Example:
        >>> StageExit(hidden).value is hidden
        True
    """

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


class Exit(nn.Module):
    """Stands where the next stage's first module was: ends the forward there with what reached
    it (:class:`StageExit`), so a stage that is not the last returns its last module's output,
    not what the model's forward would compute after it (Gemma-2 soft-caps its logits in the
    forward, which would then be applied to hidden states).

    Example:
        >>> Exit()(hidden)
        Traceback (most recent call last):
        StageExit
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Raise :class:`StageExit` with the first input."""
        raise StageExit(args[0] if args else next(iter(kwargs.values()), None))


@attrs.define
class Inbox:
    """What a stage received from the previous stage, for its :class:`Handoff`: set by the
    stage module around each forward call of its view (``None`` outside one).

    Example:
        >>> Inbox().value is None
        True
    """

    value: torch.Tensor | None = None


class Handoff(PassThrough):
    """Stands where the previous stage's last module was: returns what the previous stage
    sent (the stage's input), so the stage's first module gets exactly that, whatever the
    model's forward computed on the way (Gemma-2 scales its embeddings in the forward, which a
    stage fed ``inputs_embeds`` would do again).

    Example:
        >>> inbox = Inbox(hidden); Handoff(inbox)(anything) is hidden
        True
    """

    def __init__(self, inbox: Inbox, width: int = 0) -> None:
        super().__init__(width)
        self.inbox = inbox

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The stage's input, else (outside a stage's call) the pass-through's answer."""
        if self.inbox.value is None:
            return super().forward(*args, **kwargs)
        return self._shaped(self.inbox.value)


@attrs.frozen
class StagePlan:
    """Which stage each unit of the model belongs to (``-1``: every stage keeps it).

    Example:
        >>> stage_plan(net, ["layers.2"]).stage_of["head"]
        1
    """

    units: tuple[str, ...]
    stages: tuple[int, ...]
    num_stages: int
    crossed: frozenset[str]
    """The modules the split crosses (the root is ``""``): copied per stage, never kept whole."""
    embeddings: frozenset[str] = frozenset()
    """The units that are ``nn.Embedding`` layers (see :func:`stage_view`'s ``embeds``)."""
    widths: Mapping[str, int] = attrs.field(factory=dict, hash=False)
    """Units that returned a tuple in the traced forward: its length (their pass-throughs
    return one too)."""

    @property
    def stage_of(self) -> dict[str, int]:
        """Unit name -> stage number."""
        return dict(zip(self.units, self.stages, strict=True))

    def units_of(self, stage: int) -> tuple[str, ...]:
        """The units stage ``stage`` holds (with the helpers every stage keeps)."""
        return tuple(u for u, s in zip(self.units, self.stages, strict=True)
                     if s in (stage, SHARED))

    def after(self, stage: int) -> str | None:
        """The next stage's first own unit, or ``None`` for the last stage.

        Example:
            >>> stage_plan(net, ["layers.2"]).after(0)
            'layers.2'
        """
        if stage + 1 >= self.num_stages:
            return None
        return self.units[self.stages.index(stage + 1)]

    def before(self, stage: int) -> str | None:
        """The unit the forward runs just before stage ``stage``'s first own unit (the
        previous stage's last), or ``None`` for the first stage.

        Example:
            >>> stage_plan(net, ["layers.2"]).before(1)
            'layers.1'
        """
        first = self.stages.index(stage)
        earlier = [u for u, s in zip(self.units[:first], self.stages[:first], strict=True)
                   if s != SHARED]
        return earlier[-1] if earlier else None


def _outermost(names: list[str]) -> list[str]:
    prefixes = tuple(n + "." for n in names)
    return [n for n in names if not any(n.startswith(p) for p in prefixes if p != n + ".")]


def block_names(model: nn.Module) -> list[str]:
    """The model's repeated blocks, by name, in order: its ``_no_split_modules`` classes
    (transformers' decoder layers), else the children of its largest container.

    Example:
        >>> block_names(llama)[:2]
        ['model.layers.0', 'model.layers.1']
    """
    declared = set(declared_blocks(model))
    if declared:
        return _outermost([name for name, module in model.named_modules()
                           if name and type(module).__name__ in declared])
    best, best_size = "", 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    if not best_size:
        return []
    container = model.get_submodule(best)
    return [f"{best}.{child}" if best else child for child, module in container.named_children()
            if any(True for _ in module.parameters())]


def split_points(model: nn.Module, plan: object, num_stages: int) -> list[str]:
    """The module names that start stages 1..n-1 for ``plan``.

    Args:
        model: the whole model.
        plan: split points (module names), an int (that many stages) or ``"auto"``.
        num_stages: the stages the schedule runs (``pp_size * stages_per_rank``).

    Raises:
        ConfigError: a plan of the wrong kind, stages that do not match, or more stages than
            the model has blocks.

    Example:
        >>> split_points(net, "auto", 2)
        ['layers.2']
    """
    if isinstance(plan, list | tuple):
        if not all(isinstance(p, str) for p in plan):
            raise ConfigError(f"pp_plan={plan!r} must list module names, e.g. ['layers.4'].")
        if len(plan) + 1 != num_stages:
            raise ConfigError(
                f"pp_plan={list(plan)!r} makes {len(plan) + 1} stages, but the schedule runs "
                f"{num_stages} (pp_size x stages_per_rank). Give {num_stages - 1} split "
                "point(s), or `pp_plan='auto'`."
            )
        return list(plan)
    if isinstance(plan, bool) or not (isinstance(plan, int) or plan == "auto"):
        raise ConfigError(
            f"pp_plan={plan!r} must be a list of module names that start a stage "
            "(e.g. ['layers.4']), a number of stages, or 'auto'."
        )
    if isinstance(plan, int) and plan != num_stages:
        raise ConfigError(
            f"pp_plan={plan} stages, but the schedule runs {num_stages} (pp_size x "
            f"stages_per_rank). Use `pp_plan={num_stages}` or set stages_per_rank."
        )
    blocks = block_names(model)
    if len(blocks) < num_stages:
        raise ConfigError(
            f"The model ({type(model).__name__}) has {len(blocks)} block(s) to split but the "
            f"pipeline needs {num_stages} stages (pp_size x stages_per_rank): more stages than "
            "blocks. Use a smaller pp_size or stages_per_rank, or name the split points "
            "yourself: `pp_plan=['layers.2', ...]`."
        )
    return [blocks[k * len(blocks) // num_stages] for k in range(1, num_stages)]


def crossed_modules(model: nn.Module, splits: Sequence[str]) -> frozenset[str]:
    """The modules on the path to each split point (the root is ``""``).

    Raises:
        ConfigError: a split point that names no module of ``model``.

    Example:
        >>> sorted(crossed_modules(llama, ["model.layers.1"]))
        ['', 'model', 'model.layers']
    """
    names = dict(model.named_modules())
    crossed = {""}
    for point in splits:
        if point not in names or not point:
            near = [n for n in names if n and n.rsplit(".", 1)[-1] == point.rsplit(".", 1)[-1]]
            raise ConfigError(
                f"pp_plan names {point!r}, which is no module of {type(model).__name__} "
                f"(modules with that last name: {near[:4]}). Name a module from "
                "`model.named_modules()`, e.g. 'layers.4'."
            )
        parts = point.split(".")
        crossed.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(crossed)


def stage_plan(model: nn.Module, splits: Sequence[str], trace: ForwardTrace | None = None
               ) -> StagePlan:
    """Place every unit of ``model`` on a stage; ``splits`` start stages 1, 2, ...

    Parameters tied between units of different stages are allowed (each stage keeps a copy:
    :mod:`accel.parallel.pipeline.ties`). With a ``trace`` of the whole model's forward the
    units are ordered as the forward calls them (a unit it never called stays right after
    the unit registered before it), and the plan records which return tuples.

    Raises:
        ConfigError: a split point that names no module, splits out of the forward's order
            (or one inside another), a stage left without parameters, or a parameter that
            sits directly on a module the split crosses.

    Example:
        >>> stage_plan(net, ["layers.2"]).units_of(0)
        ('embed', 'layers.0', 'layers.1')
    """
    crossed = crossed_modules(model, splits)
    for point in splits:
        if point in crossed:
            raise ConfigError(f"pp_plan split point {point!r} contains another split point; "
                              "name modules at the same depth or disjoint ones.")
    units: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        direct = [n for n, _ in module.named_parameters(recurse=False)]
        if direct:
            raise ConfigError(
                f"Parameters {direct} sit directly on {prefix or 'the root'!r} "
                f"({type(module).__name__}), which the pipeline split {list(splits)} crosses: "
                "no stage can own them. Split at modules that do not contain them."
            )
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full in crossed:
                walk(full, child)
            else:
                units.append((full, child))

    walk("", model)
    if trace is not None:
        units = _forward_order(units, trace)
    order = [name for name, _ in units]
    where = [order.index(point) for point in splits]
    if where != sorted(where) or len(set(where)) != len(where):
        raise ConfigError(
            f"pp_plan={list(splits)!r} is not in the model's order (its units run "
            f"{order[:6]}...). List the split points in the order the forward reaches them."
        )
    stages: list[int] = []
    stage = 0
    for name, module in units:
        if stage < len(splits) and name == splits[stage]:
            stage += 1
        has_params = any(True for _ in module.parameters())
        has_buffers = any(True for _ in module.buffers())
        stages.append(SHARED if not has_params and has_buffers else stage)
    embeddings = frozenset(n for n, m in units if isinstance(m, nn.Embedding))
    widths = {} if trace is None else {u: trace.tuples[u] for u in order if u in trace.tuples}
    plan = StagePlan(tuple(order), tuple(stages), len(splits) + 1, crossed, embeddings, widths)
    for s in range(plan.num_stages):
        owned = [u for u, k in zip(order, stages, strict=True) if k == s]
        if not any(any(True for _ in model.get_submodule(u).parameters()) for u in owned):
            raise ConfigError(
                f"Pipeline stage {s} of {plan.num_stages} holds no parameters (its modules: "
                f"{owned}) with pp_plan={list(splits)!r}. Move the split points so that "
                "every stage holds a layer."
            )
    return plan


def _forward_order(units: list[tuple[str, nn.Module]], trace: ForwardTrace
                   ) -> list[tuple[str, nn.Module]]:
    """``units`` in the order the traced forward first called them (stable: a unit it never
    called keeps its place after the unit registered before it)."""
    keys: list[float] = []
    last = -1.0
    for name, _ in units:
        called = trace.rank.get(name)
        last = float(called) if called is not None else last + 1e-6
        keys.append(last)
    ranked = sorted(range(len(units)), key=lambda i: (keys[i], i))
    return [units[i] for i in ranked]


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s children, parameters and buffers, with its own
    dicts (registering or hooking on it leaves ``module`` as it is)."""
    clone = copy.copy(module)
    for key, value in list(vars(clone).items()):
        if isinstance(value, dict):
            vars(clone)[key] = copy.copy(value)
    return clone


def stage_view(model: nn.Module, plan: StagePlan, stage: int, embeds: bool = False,
               inbox: Inbox | None = None) -> nn.Module:
    """The module that runs stage ``stage``: the model's own forward, with the units of other
    stages replaced by pass-throughs. Only the modules the split crosses are new objects; the
    stage's units are the model's own (their parameters are shared, nothing is copied).
    ``embeds``: the stage is fed its input as ``inputs_embeds=`` (a transformers model after
    the first stage), so the embedding layers of earlier stages add nothing
    (:class:`NoEmbedding`). ``inbox``: the previous stage's last unit becomes a
    :class:`Handoff` that gives the stage's first unit what the previous stage sent, and the
    next stage's first unit an :class:`Exit` that ends the forward with the stage's output
    (the caller catches :class:`StageExit`).

    Example:
        >>> view = stage_view(net, stage_plan(net, ["layers.2"]), 1)
        >>> type(view.embed).__name__
        'PassThrough'
    """
    mine = set(plan.units_of(stage))
    handoff = plan.before(stage) if inbox is not None else None
    exit_at = plan.after(stage) if inbox is not None else None

    def build(prefix: str, module: nn.Module) -> nn.Module:
        clone = _shallow(module)
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            width = plan.widths.get(full, 0)
            if full in plan.crossed:
                clone._modules[name] = build(full, child)
            elif full == handoff:
                assert inbox is not None
                clone._modules[name] = Handoff(inbox, width)
            elif full == exit_at:
                clone._modules[name] = Exit()
            elif full not in mine:
                earlier = (embeds and full in plan.embeddings
                           and plan.stage_of[full] < stage)
                clone._modules[name] = NoEmbedding() if earlier else PassThrough(width)
        return clone

    return build("", model)


def keep_stages(model: nn.Module, plan: StagePlan, stages: Sequence[int]) -> None:
    """Replace, in place, every unit of ``model`` that none of ``stages`` holds with a
    :class:`PassThrough` (their weights are freed; names of the rest do not change).

    Example:
        >>> keep_stages(net, plan, [0])
        >>> sorted(net.state_dict())[:1]
        ['embed.weight']
    """
    mine = {u for s in stages for u in plan.units_of(s)}
    for name in plan.units:
        if name not in mine:
            parent, _, leaf = name.rpartition(".")
            model.get_submodule(parent)._modules[leaf] = PassThrough(plan.widths.get(name, 0))

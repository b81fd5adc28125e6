"""The tensor-parallel plan language, and the plan checked before anything is split.

A plan maps module-name patterns to styles. A pattern is a module name whose parts may be
``*`` (any one part: ``"layers.*.mlp.up_proj"``); a style is ``"colwise"``, ``"rowwise"``,
``"sequence_parallel"``, one of the names transformers models use in their own plans (mapped to
the torch style that does the same), or a torch ``ParallelStyle``. ``tp_plan="auto"`` takes the
plan a transformers model carries (``model.tp_plan``).

:func:`check_plan` checks each planned module on every rank (it reads only the model and the
plan, so every rank refuses alike, before any collective): the style fits the module's type,
the dimension it splits shares out over the ``tp`` ranks, and a column split feeding a row
split beside it hands over the layout that one expects. :mod:`accel.parallel.tensor_parallel`
applies a checked plan.

Example:
    >>> check_plan(model, {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, 2)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from accel.core.once import first_time
from accel.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["STYLE_NAMES", "check_plan", "matching_modules", "model_plan", "to_style"]

STYLE_NAMES = (
    "colwise", "rowwise", "sequence_parallel", "colwise_gather_output", "colwise_rep",
    "rowwise_split_input", "rowwise_rep", "embedding_rowwise",
)
"""The style names a plan may use (the last five are transformers' spellings)."""


def to_style(style: object, pattern: str) -> ParallelStyle:
    """The torch ``ParallelStyle`` for a plan entry.

    Raises:
        ConfigError: a name accel cannot map to a torch style, or another kind of value.

    Example:
        >>> type(to_style("colwise", "layers.*.up")).__name__
        'ColwiseParallel'
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(style, ParallelStyle):
        return style
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "sequence_parallel":
        return SequenceParallel()
    if style in ("colwise_gather_output", "colwise_rep"):  # the output gathered in full
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise"):
        return _embedding_rowwise()  # a full input, split here
    raise ConfigError(
        f"tp_plan[{pattern!r}] = {style!r} is not a style accel can apply; use one of "
        f"{list(STYLE_NAMES)} or a torch ParallelStyle (e.g. "
        "`torch.distributed.tensor.parallel.ColwiseParallel(use_local_output=False)`)."
    )


def _embedding_rowwise() -> ParallelStyle:
    """``RowwiseParallel(input_layouts=Replicate())`` whose output, on an ``nn.Embedding``, is
    a plain tensor.

    torch reduces the partial embeddings asynchronously and hands on an
    ``AsyncCollectiveTensor``; fed to a compiled block (regional compile), AOTAutograd routes its
    gradient past the reduction's backward, which then fails ("'Tensor' object has no attribute
    '_local_tensor'"). One copy of the embeddings makes it a plain tensor (waiting for the
    reduction, as the first op on it would).
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    class EmbeddingRowwise(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                               outputs: Any, device_mesh: Any) -> Any:
            out = RowwiseParallel._prepare_output_fn(  # type: ignore[no-untyped-call]
                output_layouts, use_local_output, mod, outputs, device_mesh)
            if isinstance(out, AsyncCollectiveTensor) and isinstance(mod, nn.Embedding):
                return out.clone()
            return out

    return EmbeddingRowwise(input_layouts=Replicate())


def model_plan(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan a transformers model carries (``tp_plan="auto"``).

    Raises:
        ConfigError: the model has no plan.

    Example:
        >>> model_plan(LlamaForCausalLM(config))["model.layers.*.mlp.up_proj"]
        'colwise'
    """
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, Mapping) or not plan:
        config = getattr(model, "config", None)
        plan = getattr(config, "base_model_tp_plan", None)
        prefix = getattr(model, "base_model_prefix", "")
        if isinstance(plan, Mapping) and prefix and hasattr(model, prefix):
            plan = {f"{prefix}.{key}": value for key, value in plan.items()}
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(
            f"tp_plan='auto': {type(model).__name__} carries no tensor-parallel plan "
            "(transformers models have one as `model.tp_plan`). Give the plan yourself, e.g. "
            "`tp_plan={'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': "
            "'rowwise'}`."
        )
    return dict(plan)


def _matches(pattern: str, name: str) -> bool:
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True))


def matching_modules(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Each module name of ``model`` and the plan entry whose pattern names it (first wins).

    Raises:
        ConfigError: a pattern that names no module (a typo would otherwise split nothing).

    Example:
        >>> matching_modules(model, {"blocks.*.up": "colwise"})
        {'blocks.0.up': 'colwise', 'blocks.1.up': 'colwise'}
    """
    return {name: style for name, (_, style) in _matching_entries(model, plan).items()}


def _matching_entries(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Each planned module name: (the pattern that names it, its style), first pattern wins."""
    names = [name for name, _ in model.named_modules() if name]
    chosen: dict[str, tuple[str, Any]] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(
                f"tp_plan keys are module-name patterns (strings), got {pattern!r}; e.g. "
                "`{'layers.*.mlp.up_proj': 'colwise'}`."
            )
        found = [name for name in names if _matches(pattern, name)]
        if not found:
            close = [n for n in names if n.rsplit(".", 1)[-1] == pattern.rsplit(".", 1)[-1]]
            raise ConfigError(
                f"tp_plan pattern {pattern!r} names no module of {type(model).__name__}"
                f"{f' (modules with that last name: {close[:3]})' if close else ''}. Patterns "
                "are full module names from `model.named_modules()`, with `*` for one part."
            )
        for name in found:
            chosen.setdefault(name, (pattern, style))
    return chosen


_SEQUENCE_SUFFIXES = ("layernorm", "rmsnorm", "dropout")
"""Class-name endings (lower case) of the modules ``"sequence_parallel"`` takes beside torch's."""

_PAIR_HINT = (
    "`'colwise'` then `'rowwise'`, or `'colwise_gather_output'` then `'rowwise_split_input'`"
)


def _applicable(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """The entries of a model's own plan accel can apply. Left out: patterns naming no module
    of this configuration (a model's plan covers its variants: Qwen2-MoE's dense MLPs), and,
    said once per model class (and block), transformers' styles for fused expert weights
    (``packed_colwise``, ``moe_tp_experts``...) and patterns naming a parameter rather than a
    module: those weights stay whole on every tp rank, which computes the same, in their full
    memory."""
    modules = [name for name, _ in model.named_modules() if name]
    params = [name for name, _ in model.named_parameters()]
    kept: dict[str, Any] = {}
    left: list[str] = []
    for pattern, style in plan.items():
        on_a_module = any(_matches(pattern, name) for name in modules)
        on_a_parameter = not on_a_module and any(_matches(pattern, name) for name in params)
        if not on_a_module and not on_a_parameter:
            continue  # a layer kind this configuration lacks (Qwen2-MoE's dense MLPs)
        if (isinstance(style, str) and style not in STYLE_NAMES) or on_a_parameter:
            left.append(f"{pattern!r}: {style!r}")
        else:
            kept[pattern] = style
    name = type(model).__name__
    if left and first_time((__name__, "plan left partly", name)):
        warnings.warn(
            f"tp_plan='auto': {name}'s own plan has entries accel cannot apply yet "
            f"({', '.join(left)}); those weights stay whole on every tp rank (the same "
            "results, in their full memory on each). The rest of its plan is applied.",
            stacklevel=4,
        )
    return kept


def _resolve_plan(model: nn.Module, tp_plan: object) -> dict[str, Any]:
    if isinstance(tp_plan, str) and tp_plan == "auto":
        return _applicable(model, model_plan(model))
    if isinstance(tp_plan, Mapping):
        return dict(tp_plan)
    raise ConfigError(
        f"tp_plan={tp_plan!r:.80} must be 'auto' or a mapping of module-name patterns to "
        "styles, e.g. `tp_plan={'layers.*.mlp.up_proj': 'colwise'}`."
    )


def _shape(module: nn.Module) -> str:
    """``Linear(in_features=6, out_features=5, bias=True)``: the class and its sizes."""
    return f"{type(module).__name__}({module.extra_repr()})"


def _pieces(size: int, tp: int) -> list[int]:
    """Each of ``tp`` ranks' share of a dimension of ``size`` (torch's split: ``torch.chunk``)."""
    step = -(-size // tp)
    return [max(0, min(step, size - rank * step)) for rank in range(tp)]


def _takes_sequence_shard(module: nn.Module) -> bool:
    """A norm or dropout: what torch's ``SequenceParallel`` documents it runs."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                           nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)):
        return True
    return type(module).__name__.lower().endswith(_SEQUENCE_SUFFIXES)


def _keeps_torch_apply(style: ParallelStyle) -> bool:
    """A Colwise/RowwiseParallel (or subclass) that splits the way torch's own does."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return type(style)._apply in (ColwiseParallel._apply, RowwiseParallel._apply)


def _split(module: nn.Module, style: ParallelStyle) -> tuple[str, int, bool] | None:
    """(dimension, its size, whether the shares must be equal) of what ``style`` splits.

    Equal shares are needed where a rank hands its share on as a plain tensor (a column
    split's output, a row split's input): torch takes each for an equal share of the whole.
    Where the output is gathered or the input arrives whole, torch splits unevenly itself.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        handed_on = isinstance(style.output_layouts[0], Shard) and style.use_local_output
        if isinstance(module, nn.Linear):
            return "out_features", module.out_features, handed_on
        if isinstance(module, nn.Embedding):
            return "embedding_dim", module.embedding_dim, handed_on
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Linear):
            return "in_features", module.in_features, isinstance(style.input_layouts[0], Shard)
        if isinstance(module, nn.Embedding):  # looked up on the whole input, then summed
            return "num_embeddings", module.num_embeddings, False
    return None


def _hands_on_a_share(style: ParallelStyle) -> bool:
    """A column split's output / a row split's input is each rank's share (not the whole)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return isinstance(style.output_layouts[0], Shard)
    return isinstance(style, RowwiseParallel) and isinstance(style.input_layouts[0], Shard)


def _neighbours(
    model: nn.Module, named: dict[str, tuple[str, Any, ParallelStyle]]
) -> list[tuple[str, str]]:
    """(column split, row split) pairs the plan shows: Linear siblings, the column split
    registered before the row split (no other row split between), its out_features the row
    split's in_features. Only plan entries given by name are paired."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    parents: dict[str, list[str]] = {}
    for name, (_, given, _) in named.items():
        if isinstance(given, str):
            parents.setdefault(name.rpartition(".")[0], []).append(name)
    pairs: list[tuple[str, str]] = []
    for parent, children in parents.items():
        if len(children) < 2:
            continue
        run: list[tuple[str, nn.Linear]] = []
        for child, module in model.get_submodule(parent).named_children():
            name = f"{parent}.{child}" if parent else child
            if name not in children or not isinstance(module, nn.Linear):
                continue
            style = named[name][2]
            if isinstance(style, ColwiseParallel):
                run.append((name, module))
            elif isinstance(style, RowwiseParallel):
                pairs += [(c, name) for c, m in run if m.out_features == module.in_features]
                run = []
    return pairs


def _module_problem(
    name: str, module: nn.Module, entry: tuple[str, Any, ParallelStyle], tp: int, near: str
) -> str | None:
    """Why ``entry`` cannot split ``module`` over ``tp`` ranks, or ``None``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    pattern, given, style = entry
    named = isinstance(given, str)
    said = f"tp_plan[{pattern!r}] = {given!r}" if named else (
        f"tp_plan[{pattern!r}] = {type(given).__name__}(...)")
    where = f"{name!r} ({_shape(module)})"
    drop = f"drop `{pattern!r}` from tp_plan to leave the module whole"
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and (named or _keeps_torch_apply(
            style)) and not isinstance(module, (nn.Linear, nn.Embedding)):
        other = ("plan a norm or dropout `'sequence_parallel'`" if _takes_sequence_shard(module)
                 else "give a torch `ParallelStyle` of your own for it")
        return (
            f"{said} cannot split {where} (tp_size={tp}): "
            f"{given if named else type(style).__name__!r} splits only nn.Linear and "
            f"nn.Embedding (torch's {type(style).__name__} takes no other module). Either "
            f"{other}, or {drop}."
        )
    if isinstance(style, SequenceParallel) and named and not _takes_sequence_shard(module):
        return (
            f"{said} cannot run {where} on a shard of the sequence (tp_size={tp}): "
            "'sequence_parallel' runs only norms and dropout (nn.LayerNorm, nn.RMSNorm, "
            "nn.Dropout, a module named *LayerNorm, *RMSNorm or *Dropout), as torch's "
            "SequenceParallel documents; any other module would see part of the sequence. "
            f"Plan a Linear `'colwise'` or `'rowwise'`, {drop}, or give "
            "`torch.distributed.tensor.parallel.SequenceParallel()` to apply it anyway."
        )
    split = _split(module, style) if named else None
    if split is None or split[1] < 1:  # nothing split (or sizes not known yet: a lazy module)
        return None
    dim, size, equal = split
    pieces = _pieces(size, tp)
    if equal and size % tp:
        divisors = [d for d in range(1, min(size, 64) + 1) if size % d == 0][:8]
        return (
            f"{said} cannot split {where} over tp_size={tp}: it splits {dim}={size!r}, which "
            f"{tp} ranks cannot share equally (torch's pieces: {pieces}), and each rank hands "
            f"its share on as a plain tensor{near}. Use a tp_size that divides {size} "
            f"({divisors}), make {dim} a multiple of {tp}, or {drop}."
        )
    if 0 in pieces:
        most = max(t for t in range(1, tp + 1) if 0 not in _pieces(size, t))
        return (
            f"{said} cannot split {where} over tp_size={tp}: it splits {dim}={size!r} into "
            f"torch's pieces {pieces}, leaving rank {pieces.index(0)} with none{near}. Use a "
            f"tp_size of at most {most}, or {drop}."
        )
    return None


def check_plan(model: nn.Module, tp_plan: object, tp_size: int) -> dict[str, ParallelStyle]:
    """Each module ``tp_plan`` names and its torch style, once the plan fits ``model``.

    Run by :func:`apply_tensor_parallel` on every rank before anything is split (it reads the
    model and the plan only, so every rank refuses alike, before any collective). A style
    given by name must fit its module: ``"colwise"``/``"rowwise"`` (and transformers' names
    for them) an ``nn.Linear`` or ``nn.Embedding``, ``"sequence_parallel"`` a norm or dropout.
    What the style splits must share out over ``tp_size`` ranks: equally where each rank
    hands its share on as a plain tensor (``"colwise"``: out_features / embedding_dim;
    ``"rowwise"``: in_features), with no rank left empty where torch gathers or splits the
    activation itself (an odd vocabulary under ``"colwise_gather_output"`` or
    ``"embedding_rowwise"``). A column split feeding a row split beside it must hand over what
    that one takes (a share, or the whole). A torch ``ParallelStyle`` given as an object is
    passed through; only a Colwise/RowwiseParallel that splits as torch's own is refused a
    module torch would refuse.

    Raises:
        ConfigError: the plan is not ``"auto"`` or a mapping, a pattern names no module, a
            style accel cannot map, or a planned module the plan cannot split; the first
            such module is named with its shape, its style and ``tp_size`` (the others
            refused are counted).

    Example:
        >>> check_plan(nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6)),
        ...            {"0": "colwise", "1": "rowwise"}, tp_size=2)
        Traceback (most recent call last):
        accel.errors.ConfigError: tp_plan['0'] = 'colwise' cannot split '0', a Linear(...
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size={tp_size!r} must be an integer >= 1, e.g. `tp_size=2`.")
    plan = _resolve_plan(model, tp_plan)
    entries = {name: (pattern, style, to_style(style, pattern))
               for name, (pattern, style) in _matching_entries(model, plan).items()}
    pairs = _neighbours(model, entries)
    problems: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if name not in entries:
            continue
        near = "".join(
            f"; it feeds {r!r}, planned {entries[r][1]!r}, which splits in_features alike"
            for c, r in pairs if c == name
        ) + "".join(
            f"; it takes the output of {c!r}, planned {entries[c][1]!r}"
            for c, r in pairs if r == name
        )
        problem = _module_problem(name, module, entries[name], tp_size, near)
        if problem is not None:
            problems.append((name, problem))
    for column, row in pairs:
        c_share, r_share = _hands_on_a_share(entries[column][2]), _hands_on_a_share(
            entries[row][2])
        if c_share != r_share:
            problems.append((column, (
                f"tp_plan splits {column!r} ({_shape(model.get_submodule(column))}) "
                f"{entries[column][1]!r}, which hands on "
                f"{'each rank its share of the' if c_share else 'the full'} output, but the "
                f"layer it feeds, {row!r} ({_shape(model.get_submodule(row))}), is planned "
                f"{entries[row][1]!r}, which takes "
                f"{'a share' if r_share else 'the full input'} (tp_size={tp_size}): the "
                f"first forward would fail on any mesh. Plan the pair alike: {_PAIR_HINT}."
            )))
    if problems:
        (_, first), rest = problems[0], [name for name, _ in problems[1:]]
        more = (f" {len(rest)} more planned module(s) are refused too: {rest[:4]}"
                f"{'...' if len(rest) > 4 else ''}." if rest else "")
        raise ConfigError(first + more)
    return {name: style for name, (_, _, style) in entries.items()}

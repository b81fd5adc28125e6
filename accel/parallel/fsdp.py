"""FSDP2: shard a model across the processes with ``torch.distributed.fsdp.fully_shard``.

``prepare_model(model, strategy="fsdp")`` (or ``strategy="fsdp"`` from ``accel.distributed``,
``accel launch --strategy fsdp`` or the config file) lands in :func:`shard_model`:
``fully_shard`` is applied to every block chosen by ``shard_modules`` (bottom-up), then to the
root, on a one-dimensional device mesh over all processes on the state's device type (CPU/gloo
or CUDA/nccl). Nothing here shards by hand: the parameters become torch's DTensors and FSDP2
all-gathers them around each block's forward and backward and reduce-scatters the gradients.

Where things live:

- the options: ``accel.state().options`` (``distributed(**options)``) merged with
  ``prepare_model``'s ``**strategy_options`` (which win), checked by :func:`fsdp_options`;
- the device mesh: in this module's ``_MESHES`` scope slot, made once per scope and device type;
- which parameters sharding replaced: marked on each replaced (old) parameter by
  ``accel.parallel.fsdp_params`` (which also checks and remaps optimizers, at prepare time only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
from torch import nn

from accel.core.once import first_time
from accel.core.options import block_specs
from accel.core.scope import ScopeSlot
from accel.core.settings import FSDP_KEYS, did_you_mean
from accel.core.state import ProcessState, state
from accel.errors import ConfigError
from accel.parallel.blocks import declared_blocks
from accel.parallel.fsdp_params import mark_replaced
from accel.precision.registry import precision_for

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "FSDPOptions",
    "default_shard_modules",
    "fsdp_options",
    "is_fsdp_module",
    "shard_model",
    "shard_targets",
]


_MESHES: ScopeSlot[dict[tuple[str, int], DeviceMesh]] = ScopeSlot(
    "accel.parallel.fsdp device meshes"
)
_EXAMPLES = {
    "shard_modules": "shard_modules=MyBlock",
    "reshard_after_forward": "reshard_after_forward=False",
    "cpu_offload": "cpu_offload=True",
}

ShardSpec = type[nn.Module] | str


@attrs.frozen
class FSDPOptions:
    """The merged, checked FSDP options for one model.

    ``shard_modules`` is ``None`` for the default choice (the blocks of the model's largest
    ``nn.ModuleList``/``nn.Sequential``); ``given`` names the options that were set.
    """

    shard_modules: tuple[ShardSpec, ...] | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    given: tuple[str, ...] = ()


def _check_shard_modules(value: object, origin: str) -> tuple[ShardSpec, ...] | None:
    if value is None:
        return None
    return block_specs(
        value,
        comma_separated=False,
        identifiers=False,
        invalid=lambda item: (
            f"{origin}: FSDP option shard_modules={value!r} is invalid: {item!r} is neither an "
            "nn.Module subclass nor a class name. Pass a class, its name, or a list of them, "
            "e.g. `accel.prepare_model(model, strategy='fsdp', shard_modules=MyBlock)` or "
            "`shard_modules=['MyBlock']`."
        ),
        empty=(
            f"{origin}: FSDP option shard_modules={value!r} is empty. Name at least one block "
            "class, e.g. `shard_modules=MyBlock`, or leave it out for the default (the blocks "
            "of the model's largest nn.ModuleList/nn.Sequential)."
        ),
    )


def _check_bool(key: str, value: object, origin: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(
        f"{origin}: FSDP option {key}={value!r} is invalid; it must be True or False, e.g. "
        f"`accel.prepare_model(model, strategy='fsdp', {_EXAMPLES[key]})`."
    )


def fsdp_options(run_options: Mapping[str, Any], given: Mapping[str, Any]) -> FSDPOptions:
    """Merge the run's FSDP options with ``prepare_model``'s (which win) and check them.

    Args:
        run_options: ``accel.state().options`` (from ``distributed()``); keys that are not
            FSDP options (DDP options, other run-wide options) are left alone.
        given: ``prepare_model``'s ``**strategy_options``; every key must be an FSDP option.

    Returns:
        The checked options.

    Raises:
        ConfigError: an unknown key in ``given`` or an invalid value.

    Example:
        >>> fsdp_options({}, {"cpu_offload": True}).cpu_offload
        True
    """
    for key in given:
        if key not in FSDP_KEYS:
            raise ConfigError(
                f"accel.prepare_model: unknown FSDP option {key!r}"
                f"{did_you_mean(key, FSDP_KEYS)} (strategy='fsdp'); the "
                f"known ones are {list(FSDP_KEYS)}. Remove or rename it, e.g. "
                "`accel.prepare_model(model, strategy='fsdp', reshard_after_forward=False)`."
            )
    merged: dict[str, Any] = {}
    for key in FSDP_KEYS:
        if key in given:
            merged[key] = (given[key], "accel.prepare_model")
        elif key in run_options:
            merged[key] = (run_options[key], "accel.distributed()")
    values: dict[str, Any] = {}
    if "shard_modules" in merged:
        values["shard_modules"] = _check_shard_modules(*merged["shard_modules"])
    for key in ("reshard_after_forward", "cpu_offload"):
        if key in merged:
            values[key] = _check_bool(key, *merged[key])
    return FSDPOptions(**values, given=tuple(merged))


def default_shard_modules(model: nn.Module) -> list[nn.Module]:
    """The default blocks to shard: the model's declared blocks, else its largest container's.

    A model that declares its blocks (transformers' ``_no_split_modules``, see
    :func:`accel.parallel.blocks.declared_blocks`) has every module of those classes sharded.
    Otherwise the blocks are the children of the largest ``ModuleList``/``Sequential``:
    "largest" counts parameters (the first one found wins a tie); blocks without parameters
    are left to their parent. A model with no such container (or whose containers hold no
    parameters) gives an empty list: the root alone is sharded.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> [type(m).__name__ for m in default_shard_modules(net)]
        ['Linear', 'Linear']
    """
    declared = set(declared_blocks(model))
    if declared:
        return [
            module for module in model.modules()
            if module is not model and type(module).__name__ in declared
        ]
    best: nn.Module | None = None
    best_size = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = module, size
    if best is None:
        return []
    return [child for child in best.children() if any(True for _ in child.parameters())]


def _class_names(model: nn.Module) -> list[str]:
    return sorted({type(module).__name__ for module in model.modules()})


def shard_targets(model: nn.Module, shard_modules: tuple[ShardSpec, ...] | None) -> list[nn.Module]:
    """The submodules to ``fully_shard`` before the root, children before their parents.

    Args:
        model: the root module (never in the result: it is sharded last, always).
        shard_modules: classes or class names; ``None`` for :func:`default_shard_modules`.

    Returns:
        The matching submodules, deepest first.

    Raises:
        ConfigError: a class (or name) in ``shard_modules`` occurs nowhere in the model.

    Example:
        >>> shard_targets(net, (nn.Linear,))
        [Linear(...), Linear(...)]
    """
    if shard_modules is None:
        chosen = {id(module) for module in default_shard_modules(model)}
    else:
        present = list(model.modules())
        for spec in shard_modules:
            if isinstance(spec, str):
                found = any(type(module).__name__ == spec for module in present)
            else:
                found = any(isinstance(module, spec) for module in present)
            if not found:
                shown = spec if isinstance(spec, str) else spec.__name__
                raise ConfigError(
                    f"FSDP option shard_modules names {shown!r}, which occurs nowhere in the "
                    f"model ({type(model).__name__!r}). Module classes in the model: "
                    f"{_class_names(model)}. Name one of them, e.g. "
                    "`accel.prepare_model(model, strategy='fsdp', shard_modules=MyBlock)`."
                )
        classes = tuple(spec for spec in shard_modules if isinstance(spec, type))
        names = {spec for spec in shard_modules if isinstance(spec, str)}
        chosen = {
            id(module)
            for module in present
            if isinstance(module, classes) or type(module).__name__ in names
        }
    chosen.discard(id(model))
    # named_modules is pre-order: reversed, every module comes after its descendants.
    return [module for module in reversed(list(model.modules())) if id(module) in chosen]


def is_fsdp_module(module: object) -> bool:
    """Whether ``module`` was sharded with ``fully_shard`` (an ``FSDPModule``).

    Example:
        >>> is_fsdp_module(nn.Linear(2, 2))
        False
    """
    return getattr(type(module), "set_requires_gradient_sync", None) is not None


def _mesh(st: ProcessState) -> DeviceMesh:
    if st.mesh is not None:  # the block's N-D mesh: shard over its data-parallel dims
        from accel.core.mesh import dp_mesh

        return dp_mesh(st.mesh)
    meshes = _MESHES.get_or_create(dict)
    key = (st.device.type, st.world_size)
    mesh = meshes.get(key)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = meshes[key] = init_device_mesh(st.device.type, (st.world_size,))
    return mesh


def describe_blocks(model: nn.Module, targets: list[nn.Module], chosen_by_user: bool) -> str:
    """One line saying which blocks FSDP shards before the root, and why those.

    Example:
        >>> describe_blocks(gpt2, shard_targets(gpt2, None), chosen_by_user=False)
        "FSDP shards 2 blocks (2 x GPT2Block), then the root: the model's _no_split_modules."
    """
    counts: dict[str, int] = {}
    for module in targets:
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    what = ", ".join(f"{n} x {c}" for c, n in counts.items()) or "none"
    why = (
        "shard_modules as given" if chosen_by_user
        else "the model's _no_split_modules" if declared_blocks(model)
        else "the children of its largest nn.ModuleList/nn.Sequential"
    )
    return f"FSDP shards {len(targets)} blocks ({what}), then the root: {why}."


def _note_blocks(model: nn.Module, targets: list[nn.Module], options: FSDPOptions) -> None:
    if state().is_main_process:
        from accel.comm.gating import get_logger

        get_logger(__name__, main_process_only=False).info(
            "%s", describe_blocks(model, targets, options.shard_modules is not None)
        )


def _note_one_process() -> None:
    if not first_time((__name__, "one process")):
        return
    from accel.comm.gating import get_logger

    get_logger(__name__, main_process_only=False).info(
        "strategy='fsdp' with one process: the model is not sharded (there is nothing to shard "
        "it across) and trains as a plain module; the same script shards it when launched "
        "with several processes. Said once per block."
    )


def shard_model(
    model: nn.Module,
    options: FSDPOptions,
    *,
    evaluation_mode: bool = False,
    device_placement: bool = True,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard`` per ``options`` and return it.

    On one process (or with ``evaluation_mode``) the options and ``shard_modules`` are still
    checked, but the model is only moved to the state's device: one process has nothing to
    shard across (an info note says so, once per block). With several processes, the
    mode's precision unit (``accel.precision``) first makes the master weights (under mixed
    precision trainable bf16/fp16 parameters are upcast to fp32); then every module of
    :func:`shard_targets` and finally the root get ``fully_shard`` on the mesh, with
    ``reshard_after_forward`` (when not given: torch's default, which reshards every block
    but not the root, whose parameters the backward needs first, so that it is not gathered
    twice per step), ``CPUOffloadPolicy`` when ``cpu_offload`` and the unit's
    ``MixedPrecisionPolicy`` (param and reduce dtypes). ``fully_shard`` places the shards
    itself (on the state's device, or the CPU with ``cpu_offload``).

    Args:
        model: the user's module (not yet sharded).
        options: from :func:`fsdp_options`.
        evaluation_mode: inference only: no sharding (as no DDP wrapper for ``"ddp"``).
        device_placement: move the unsharded model to the state's device.

    Returns:
        ``model`` itself, now an ``FSDPModule`` of its own class when sharded.

    Raises:
        ConfigError: a ``shard_modules`` class that occurs nowhere in the model.

    Example:
        >>> model = shard_model(net, fsdp_options({}, {"shard_modules": "Block"}))
    """
    targets = shard_targets(model, options.shard_modules)
    st = state()
    # Context-parallel ranks join the FSDP group (they hold the same weights).
    group = st.dp_world_size * st.cp_world_size
    if group == 1 or evaluation_mode or is_fsdp_module(model):
        if st.world_size == 1 and not evaluation_mode:
            _note_one_process()
        return model.to(st.device) if device_placement else model
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    unit = precision_for(st.mixed_precision)
    unit.upcast_master_weights(model)  # fp32 master weights under mixed precision
    kwargs: dict[str, Any] = {
        "mesh": _mesh(st),
        "reshard_after_forward": (
            options.reshard_after_forward if "reshard_after_forward" in options.given else None
        ),
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=st.device.type == "cuda")
            if options.cpu_offload else OffloadPolicy()
        ),
    }
    policy = unit.fsdp_policy()
    if policy is not None:
        kwargs["mp_policy"] = policy
    _note_blocks(model, targets, options)
    before = dict(model.named_parameters())
    for module in targets:
        if not is_fsdp_module(module):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if callable(getattr(model, "generate", None)):
        # transformers' generate() may call submodules (T5's encoder, peft's base model)
        # without the root's forward: the root's own shards are gathered around it too.
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    mark_replaced(model, before)
    return model

"""DeepSpeed's engine behind accel's loop: ``deepspeed.initialize`` from ``accel.prepare`` and
the hooks the training layer calls under ``strategy="deepspeed"``.

- :func:`initialize`: the config resolved (:mod:`~accel.parallel.deepspeed.config`), no C++
  extension built on the CPU (DeepSpeed's shared-memory all-reduce op is skipped: gloo does
  the reductions), ``LOCAL_RANK`` given to DeepSpeed for the block, a one-process gloo group
  when the run has none; the engine is kept in the block's scope;
- :func:`backward`: ``engine.backward`` with the engine told whether this batch ends an
  optimizer step (``accel.accumulate``'s sync flag: the engine reduces and steps then);
- :func:`step`: ``engine.step`` (the prepared optimizer's ``step``; the engine zeroes the
  gradients itself, so ``zero_grad`` has nothing to do);
- :func:`clip_grad_norm`: the config's ``gradient_clipping`` checked against the loop's (the
  engine clips inside its step);
- :func:`inner_module`: the user's module inside an engine.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from accel.core.agreement import agree_on_settings, settings_of
from accel.core.env import read_variable
from accel.core.exit_refs import final_barrier
from accel.core.scope import ScopeSlot, at_block_exit
from accel.core.settings import DEEPSPEED_KEYS
from accel.core.state import state
from accel.errors import ConfigError
from accel.parallel.deepspeed.config import Facts, build_config, resolve_config
from accel.parallel.deepspeed.ops import prefer_torch_adam, warn_builds
from accel.parallel.deepspeed.sections import Client
from accel.precision.casting import prepare_forward

__all__ = [
    "EngineRun",
    "backward",
    "clip_grad_norm",
    "current_run",
    "import_deepspeed",
    "initialize",
    "inner_module",
    "refuse",
    "start_deepspeed",
    "step",
]

_EXTRA = "`pip install 'accel[deepspeed]'` (DeepSpeed 0.19.8)"


@attrs.define
class EngineRun:
    """The block's DeepSpeed engine, the config it runs and where its clipping comes from.

    Example:
        >>> current_run().engine.zero_optimization_stage()
        3
    """

    engine: Any
    config: dict[str, Any]
    clip_from_loop: bool
    user_optimizer: Any = None
    groups: list[list[nn.Parameter]] = attrs.Factory(list)
    """The parameters of each optimizer group as the user built them (DeepSpeed replaces
    them with flat partitions): a checkpoint keeps the optimizer state in this order."""


_RUN: ScopeSlot[EngineRun] = ScopeSlot("accel.parallel.deepspeed engine")


def import_deepspeed() -> ModuleType:
    """The ``deepspeed`` module.

    Raises:
        ConfigError: DeepSpeed is not installed (names the extra).

    Example:
        >>> import_deepspeed().__version__
        '0.19.8'
    """
    try:
        return importlib.import_module("deepspeed")
    except ImportError as exc:
        raise ConfigError(
            f"strategy='deepspeed' needs DeepSpeed, which cannot be imported ({exc}). "
            f"Install the extra: {_EXTRA}."
        ) from None


def current_run() -> EngineRun:
    """The engine prepared in this block.

    Raises:
        ConfigError: no model was prepared under ``strategy="deepspeed"`` in the block.

    Example:
        >>> current_run().engine  # after accel.prepare(model, optimizer, loader)
        DeepSpeedEngine(...)
    """
    run = _RUN.get()
    if run is None:
        raise ConfigError(
            "strategy='deepspeed' but no model was prepared in this block: call "
            "`model, optimizer, loader = accel.prepare(model, optimizer, loader)` first."
        )
    return run


def refuse(what: str) -> ConfigError:
    """The error for an accel call that DeepSpeed's engine does not support.

    Example:
        >>> raise refuse("accel.prepare_model")
    """
    return ConfigError(
        f"{what} is not available under strategy='deepspeed'. Pass the model with its optimizer "
        "and data loader to `accel.prepare(model, optimizer, loader, scheduler)`, which hands "
        "them to `deepspeed.initialize`; see docs/deepspeed.md."
    )


def _micro_batch(loaders: Iterable[Any], world_size: int) -> int | None:
    for loader in loaders:
        total = getattr(loader, "total_batch_size", None)
        if isinstance(total, int) and total % world_size == 0:
            return total // world_size
        size = getattr(loader, "batch_size", None)
        if isinstance(size, int):
            return size
    return None


def _hidden_size(model: nn.Module) -> int | None:
    size = getattr(getattr(model, "config", None), "hidden_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _no_shm_build(ds: ModuleType, device: torch.device) -> None:
    """On the CPU, DeepSpeed would compile its shared-memory all-reduce op (minutes, g++ and
    ninja) when its communication backend starts; gloo does the reductions instead."""
    if device.type != "cpu":
        return
    ops = importlib.import_module("deepspeed.ops")
    compatible = ops.__compatible_ops__  # DeepSpeed probes once and keeps this dict
    compatible["deepspeed_shm_comm"] = False


def _give_local_rank(local_rank: int) -> None:
    """DeepSpeed reads ``LOCAL_RANK`` from the environment (torchrun and ``accel launch`` set
    it); other launchers get it for the block."""
    if read_variable("LOCAL_RANK") is not None:
        return
    import os

    os.environ["LOCAL_RANK"] = str(local_rank)

    def _remove(failed: bool) -> None:
        os.environ.pop("LOCAL_RANK", None)

    at_block_exit(_remove)


def _one_process_group() -> None:
    """A gloo group of one process for a one-process run (DeepSpeed needs a group), left at
    the end of the block."""
    if dist.is_initialized():
        return
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def _leave(failed: bool) -> None:
        if dist.is_initialized():
            final_barrier()  # one process: never waits on anyone (see accel.core.exit_refs)
            dist.destroy_process_group()

    at_block_exit(_leave)


def start_deepspeed() -> ModuleType:
    """``deepspeed``, ready to start its communication in this block: no C++ build on the
    CPU, ``LOCAL_RANK`` set, a process group (one process of gloo when the run has none).

    Raises:
        ConfigError: DeepSpeed is not installed (names the extra).

    Example:
        >>> start_deepspeed().zero.Init   # before deepspeed.initialize or zero.Init
        <class 'deepspeed.runtime.zero.partition_parameters.Init'>
    """
    st = state()
    ds = import_deepspeed()
    _no_shm_build(ds, st.device)
    _give_local_rank(st.local_rank)
    _one_process_group()
    return ds


def initialize(
    model: nn.Module, optimizer: Any, loaders: Iterable[Any], scheduler: Any = None
) -> EngineRun:
    """Hand ``model`` and ``optimizer`` to ``deepspeed.initialize`` with the resolved config.

    Every rank must call it (DeepSpeed broadcasts the weights and partitions them).

    Args:
        model: the user's module (not yet prepared).
        optimizer: the user's torch optimizer, or ``None`` when the config builds one.
        loaders: the prepared data loaders (the first gives the micro batch size).
        scheduler: the user's torch LR scheduler passed with them, or ``None`` (the config's
            ``"scheduler"`` section is refused beside one).

    Returns:
        The block's :class:`EngineRun`.

    Raises:
        ConfigError: DeepSpeed missing, an invalid or unresolvable config, a second engine
            in the block; ranks whose configs differ once filled (every rank raises, naming
            each key, e.g. ``deepspeed.train_micro_batch_size_per_gpu``).

    Example:
        >>> run = initialize(model, optimizer, [loader])
        >>> run.engine.zero_optimization_stage()
        2
    """
    if _RUN.get() is not None:
        raise ConfigError(
            "strategy='deepspeed' runs one engine per block and a model was already prepared; "
            "train one model per `accel.distributed()` block (or wrap your models in one "
            "nn.Module)."
        )
    st = state()
    options = {key: st.options.get(key) for key in DEEPSPEED_KEYS}
    config = build_config(
        options["deepspeed_config"], zero_stage=options["zero_stage"],
        offload_optimizer=options["offload_optimizer"], offload_params=options["offload_params"],
    )
    clip = options["gradient_clipping"]
    facts = Facts(
        mixed_precision=st.mixed_precision,
        gradient_accumulation_steps=st.gradient_accumulation_steps,
        world_size=st.world_size,
        micro_batch=_micro_batch(loaders, st.world_size),
        gradient_clipping=None if clip is None else float(clip),
        hidden_size=_hidden_size(model),
        client_optimizer=optimizer is not None,
        client=Client.of(optimizer, scheduler),
    )
    resolved = resolve_config(config, facts)
    ds = start_deepspeed()
    final = prefer_torch_adam(resolved.config, st.device.type)  # no build on a CPU
    agree_on_settings("accel.prepare() (deepspeed.initialize)", {
        **settings_of(st), "deepspeed": final, "model": type(model),
        "optimizer": None if optimizer is None else type(optimizer),
        "scheduler": None if scheduler is None else type(scheduler),
        "gradient clipping from the loop": resolved.clip_from_loop,
    }, device=st.device)  # the config as filled, before DeepSpeed's first collective
    warn_builds(final, client_optimizer=optimizer is not None)
    kwargs: dict[str, Any] = {"model": model, "config": final}
    groups = (
        [list(g["params"]) for g in optimizer.param_groups] if optimizer is not None
        else [[p for p in model.parameters() if p.requires_grad]]
    )
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    else:
        kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    engine = ds.initialize(**kwargs)[0]
    prepare_forward(engine.module)  # autocast in, fp32 out, as for DDP and FSDP
    run = EngineRun(
        engine=engine, config=final, clip_from_loop=resolved.clip_from_loop,
        user_optimizer=optimizer, groups=groups,
    )
    _RUN.set(run)
    return run


def backward(loss: torch.Tensor, **kwargs: Any) -> None:
    """``engine.backward(loss)``: the engine divides by the accumulation steps and scales fp16;
    it reduces gradients when this batch ends an optimizer step (``accel.accumulate``).

    Example:
        >>> backward(loss)   # accel.backward under strategy="deepspeed"
    """
    from accel.core.scope import scope

    engine = current_run().engine
    engine.set_gradient_accumulation_boundary(scope().sync_gradients)
    engine.backward(loss, **kwargs)


def step(prepared: Any) -> None:
    """``engine.step()`` (the optimizer step on a sync step; DeepSpeed clips, steps, zeroes
    the gradients); records on ``prepared`` whether the step was skipped (fp16 overflow).

    Example:
        >>> step(optimizer)   # optimizer.step() under strategy="deepspeed"
    """
    from accel.core.scope import scope

    engine = current_run().engine
    sync = scope().sync_gradients
    engine.set_gradient_accumulation_boundary(sync)
    engine.step()
    if sync:
        applied = getattr(engine, "was_step_applied", None)
        prepared.step_was_skipped = not applied() if callable(applied) else False
        prepared.step_ran = not prepared.step_was_skipped


def _set_clipping(engine: Any, value: float) -> None:
    engine._config.gradient_clipping = value
    inner = getattr(engine, "optimizer", None)
    if inner is not None and hasattr(inner, "clip_grad"):
        inner.clip_grad = value


def clip_grad_norm(max_norm: float, norm_type: float) -> torch.Tensor:
    """Check the loop's clip against the config's ``gradient_clipping`` (the engine clips
    inside its step); return the total norm DeepSpeed measured at its last step (NaN before).

    Under ``"auto"`` without accel's ``gradient_clipping`` option, the first call sets the
    engine's clipping to ``max_norm``.

    Raises:
        ConfigError: a value other than the config's, or a norm type other than 2.

    Example:
        >>> clip_grad_norm(1.0, 2.0)
        tensor(0.8123)
    """
    run = current_run()
    engine = run.engine
    if float(norm_type) != 2.0:
        raise ConfigError(
            f"clip_grad_norm_(norm_type={norm_type!r}) under strategy='deepspeed': DeepSpeed "
            "clips the 2-norm only. Drop norm_type."
        )
    current = float(engine.gradient_clipping())
    if run.clip_from_loop:
        _set_clipping(engine, float(max_norm))
        run.clip_from_loop = False
        run.config["gradient_clipping"] = float(max_norm)
    elif float(max_norm) != current:
        raise ConfigError(
            f"accel.clip_grad_norm_(..., max_norm={max_norm!r}) but the DeepSpeed engine clips "
            f"at gradient_clipping={current!r} (its config, or accel's gradient_clipping "
            "option). DeepSpeed clips inside its step with one value: make them equal, or "
            "set the config's gradient_clipping to \"auto\"."
        )
    norm = engine.get_global_grad_norm()
    value = float("nan") if norm is None else float(norm)
    return torch.tensor(value)


def inner_module(model: nn.Module) -> nn.Module | None:
    """The user's module when ``model`` is a DeepSpeed engine, else ``None`` (DeepSpeed is
    not imported here).

    Example:
        >>> inner_module(engine) is net
        True
    """
    runtime = sys.modules.get("deepspeed.runtime.engine")
    kind = getattr(runtime, "DeepSpeedEngine", None)
    if kind is not None and isinstance(model, kind):
        inner: nn.Module = model.module
        return inner
    return None

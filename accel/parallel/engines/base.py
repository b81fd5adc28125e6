"""The engine unit: everything one engine (``strategy=``) decides, and the single-process engine.

A unit is a frozen, stateless object, one per engine (``accel.parallel.engines.registry``),
asked by the training, weights and checkpoint layers instead of branching on
``accel.state().strategy``: how ``accel.prepare`` treats its objects (:meth:`Engine.prepare`),
what ``prepare_model`` does to the model (:meth:`Engine.place`, :meth:`Engine.wrap`, the
options it takes inside pipeline stages and under tensor parallelism), ``backward``, the
prepared optimizer's step and ``zero_grad``, clipping, ``unwrap_model``, full weights, and what
``save_state``/``load_state`` hand to the checkpoint. The state an engine keeps for a block
(DeepSpeed's engine) lives in the block's ``Scope``.

:class:`Engine` itself is ``strategy="none"``: the model is placed on the device and left
as it is (no wrapper, on any number of processes); the precision unit scales and steps.
Other engines subclass it (``ddp.py``, ``fsdp.py``, ``deepspeed.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from accel.core.options import BlockChoice
from accel.core.state import ProcessState, state
from accel.parallel.blockwise import checkpoint_blocks
from accel.parallel.ddp import DDPOptions, ddp_options, note_ignored
from accel.parallel.fsdp_params import clip_by_total_norm
from accel.precision.base import Layouts, StepRecord
from accel.precision.registry import PRECISIONS

__all__ = ["Engine", "Placed"]


@attrs.frozen
class Placed:
    """A model as :meth:`Engine.place` left it: placed (sharded under FSDP2), its
    activation checkpointing applied, and what :meth:`Engine.wrap` needs next."""

    model: nn.Module
    shard_modules: Any = None
    """The blocks FSDP2 sharded one by one (regional compilation compiles the same)."""
    ddp: DDPOptions | None = None
    """The checked DDP options (engines that may wrap in DDP, else ``None``)."""


@attrs.frozen
class Engine:
    """The single-process engine (``strategy="none"``), and what every unit answers.

    Example:
        >>> from accel.parallel.engines.registry import engine_for
        >>> engine_for("none").shards_parameters
        False
    """

    name: ClassVar[str] = "none"
    """The ``strategy`` value this unit serves."""
    shards_parameters: ClassVar[bool] = False
    """FSDP2 shards the model over the data-parallel dims (fp8 picks its recipe by it)."""

    # -- accel.prepare --------------------------------------------------------------------
    def prepare(
        self, objects: tuple[Any, ...], prepare_one: Callable[[Any], Any],
        mark: Callable[[nn.Module, nn.Module], None],
    ) -> list[Any] | None:
        """Prepare ``objects`` together (``accel.prepare``), or ``None``: one by one.

        Args:
            objects: what ``accel.prepare`` was given.
            prepare_one: prepares one object with its ``prepare_*`` function.
            mark: records that a module was prepared into another (``is_prepared``).

        Example:
            >>> engine_for("ddp").prepare((model, optimizer), prepare_one, mark) is None
            True
        """
        return None

    # -- prepare_model --------------------------------------------------------------------
    def refuse_prepare_model(self) -> None:
        """Raise where the engine prepares a model only with its optimizer (DeepSpeed).

        Example:
            >>> engine_for("ddp").refuse_prepare_model()
        """

    def stage_options(self, st: ProcessState, given: Mapping[str, Any]) -> dict[str, Any]:
        """The FSDP2 options for pipeline stages (sharded over the data-parallel dims
        whatever the engine) from ``prepare_model``'s ``**strategy_options``: the engine's
        own under FSDP2, else none (a DDP engine's are checked and said to be ignored).

        Example:
            >>> engine_for("none").stage_options(accel.state(), {})
            {}
        """
        return {}

    def under_tensor_parallel(self, st: ProcessState, evaluation_mode: bool) -> str:
        """The name of the engine that keeps tensor-parallel replicas in sync: TP weights are
        DTensors, which DDP cannot sync, so FSDP2 does over the data-parallel (and cp) ranks
        (a shard size of 1 when only ``dp_replicate`` is set); with no such rank, none.

        Example:
            >>> engine_for("ddp").under_tensor_parallel(accel.state(), False)
            'none'
        """
        note_ignored(ddp_options(st.options, {}), "tensor parallelism")
        group = st.dp_world_size * st.cp_world_size  # cp ranks sync like data-parallel ones
        return "fsdp" if group > 1 and not evaluation_mode else "none"

    def place(
        self, model: nn.Module, st: ProcessState, given: Mapping[str, Any], *,
        checkpointing: BlockChoice, evaluation_mode: bool, device_placement: bool,
    ) -> Placed:
        """Check the engine's options, apply activation checkpointing and place the model
        (FSDP2: shard it).

        Args:
            model: the model, its layers converted and TP split where asked.
            st: the block's state.
            given: ``prepare_model``'s ``**strategy_options``.
            checkpointing: the blocks whose activations are recomputed (``False``: none).
            evaluation_mode: inference only.
            device_placement: move the model to the state's device.

        Example:
            >>> placed = engine_for("none").place(model, accel.state(), {},
            ...     checkpointing=False, evaluation_mode=False, device_placement=True)
        """
        ddp = ddp_options(st.options, given)
        if checkpointing is not False:
            checkpoint_blocks(model, checkpointing)
        if device_placement:
            model = model.to(st.device)
        return Placed(model, None, ddp)

    def wrap(self, placed: Placed, st: ProcessState, evaluation_mode: bool) -> nn.Module:
        """The module to train with once the forward is prepared (DDP: its wrapper).

        Example:
            >>> engine_for("none").wrap(placed, accel.state(), False) is placed.model
            True
        """
        if placed.ddp is not None:
            note_ignored(placed.ddp, "one process" if st.world_size == 1
                         else f"strategy={self.name!r}")
        return placed.model

    def inner(self, model: nn.Module) -> nn.Module | None:
        """The module inside the engine's wrapper, or ``None`` when ``model`` is none of its
        wrappers (``unwrap_model`` asks every engine).

        Example:
            >>> engine_for("none").inner(model) is None
            True
        """
        return None

    def is_sharded(self, module: nn.Module) -> bool:
        """Whether ``module`` holds only this engine's shards of its parameters (LocalSGD
        refuses such a model; ``accel.LocalSGD`` asks every engine).

        Example:
            >>> engine_for("none").is_sharded(model)
            False
        """
        return False

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        """The context that keeps ``model``'s gradients local (``accumulate``'s non-sync
        steps, ``no_sync``), or ``None`` when ``model`` is not this engine's.

        Example:
            >>> engine_for("none").no_sync(model) is None
            True
        """
        return None

    def sync_on(self, model: nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        """The context in which the next backward synchronises ``model``'s gradients though
        its forward ran under :meth:`no_sync` (``trigger_sync_in_backward``), or ``None``.

        Example:
            >>> engine_for("none").sync_on(model) is None
            True
        """
        return None

    # -- the step ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, st: ProcessState, kwargs: dict[str, Any]) -> None:
        """``accel.backward``: the loss divided by the accumulation steps, scaled by the
        precision unit (fp16's GradScaler), backpropagated.

        Example:
            >>> engine_for("none").backward(loss, accel.state(), {})
        """
        steps = st.gradient_accumulation_steps
        if steps > 1:
            loss = loss / steps
        # the unit straight from the registry (the mode was checked when the state was made,
        # and this runs every step)
        loss = PRECISIONS[st.mixed_precision].scale_loss(loss)
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    def optimizer_scaler(self, st: ProcessState) -> torch.amp.GradScaler | None:
        """The GradScaler an optimizer prepared now steps through (the precision unit's).

        Example:
            >>> engine_for("none").optimizer_scaler(accel.state()) is None
            True
        """
        return PRECISIONS[st.mixed_precision].optimizer_scaler()

    def step(
        self, record: StepRecord, closure: Callable[[], float] | None, st: ProcessState,
        sync: bool, layouts: Layouts,
    ) -> Any:
        """The prepared optimizer's ``step``: on a sync step, through the precision unit.

        Under an N-D mesh it runs with torch's ``implicit_replication``: a tensor-parallel
        model without FSDP keeps plain parameters (layers left whole) beside DTensor ones,
        and a ``foreach`` optimizer step refuses the mix otherwise.

        Example:
            >>> engine_for("none").step(prepared, None, accel.state(), True, layout_groups)
        """
        if not sync:
            return None
        unit = PRECISIONS[st.mixed_precision]
        if st.mesh is not None:
            from torch.distributed.tensor.experimental import implicit_replication

            with implicit_replication():
                return unit.step(record, closure, layouts)
        return unit.step(record, closure, None)

    def zero_grad(self, optimizer: Any, set_to_none: bool | None, sync: bool) -> None:
        """The prepared optimizer's ``zero_grad``: on a sync step only.

        Example:
            >>> engine_for("none").zero_grad(optimizer, None, True)
        """
        if not sync:
            return
        if set_to_none is None:
            optimizer.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm(
        self, params: list[Any], max_norm: float, norm_type: float, sync: bool,
        unscale: Callable[[], None],
    ) -> torch.Tensor:
        """``accel.clip_grad_norm_``: on a sync step, unscale then clip the total norm (over
        every rank, mesh dim and pipeline stage); otherwise the norm accumulated so far, in
        unscaled units, without clipping.

        Example:
            >>> engine_for("none").clip_grad_norm(params, 1.0, 2.0, True, lambda: None)
            tensor(0.53)
        """
        if not sync:
            norm = _total_norm(params, None, norm_type)
            return PRECISIONS[state().mixed_precision].unscaled_norm(norm)
        unscale()
        return _total_norm(params, max_norm, norm_type)

    def clip_grad_value(
        self, params: list[Any], clip_value: float, sync: bool, unscale: Callable[[], None]
    ) -> None:
        """``accel.clip_grad_value_``: on a sync step, unscale then clip every element.

        Example:
            >>> engine_for("none").clip_grad_value(params, 0.5, True, lambda: None)
        """
        if not sync:
            return
        unscale()
        torch.nn.utils.clip_grad_value_(params, clip_value)

    # -- weights and checkpoints ------------------------------------------------------------
    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The full weights of a module only this engine can gather (DeepSpeed's ZeRO-3
        partitions), else ``None`` (``get_state_dict`` asks every engine).

        Example:
            >>> engine_for("none").full_state_dict(model) is None
            True
        """
        return None

    def checkpoint_objects(self, objects: dict[str, Any], *, gather: bool) -> dict[str, Any]:
        """What ``save_state`` writes (``gather=True``, a collective under engines that
        partition) and ``load_state`` fills (``gather=False``) for ``objects``: the objects
        themselves, or stand-ins that give and take the engine's state as one plain process's.

        Example:
            >>> engine_for("none").checkpoint_objects({"model": model}, gather=True)
            {'model': ...}
        """
        return objects


def _total_norm(params: list[Any], max_norm: float | None, norm_type: float) -> torch.Tensor:
    """The total norm over every rank and mesh dim, and over the pipeline's stages where the
    model is split into them."""
    from accel.parallel.pipeline.grads import stage_norm

    norm = stage_norm(params, max_norm, norm_type)
    return norm if norm is not None else clip_by_total_norm(params, max_norm, norm_type)

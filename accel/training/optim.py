"""Prepared optimizers and gradient clipping (schedulers: scheduling.py).

Where things live:

- whether the current batch is a sync step: ``accel.core.scope.scope().sync_gradients`` (set by
  ``accel.accumulate``; ``True`` when no accumulation is used);
- loss scaling: the unit of the state's mixed precision mode
  (``accel.precision.registry.precision_for``) makes the GradScaler, steps through it, unscales
  and tells a skipped step; the scaler itself is ``scope().grad_scaler`` (fp16's, one per
  ``distributed()`` scope, saved with ``accel.precision.scaling.scaler_state_dict``);
- the optimizers prepared in the scope: weak references in
  ``scope().optimizers`` (for :func:`unscale_gradients` with no argument and
  for schedulers to find their optimizer);
- per-optimizer facts (last step skipped, gradients already unscaled this step): attributes
  of the :class:`PreparedOptimizer`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from accel.core.scope import scope
from accel.core.state import ProcessState, state
from accel.errors import ArgumentTypeError, NotPicklableError
from accel.parallel.engines.registry import ENGINES, engine_for
from accel.parallel.fsdp_params import check_optimizer_parameters, layout_groups
from accel.precision.base import Layouts
from accel.precision.registry import precision_for

__all__ = [
    "PreparedOptimizer",
    "clip_grad_norm_",
    "clip_grad_value_",
    "optimizer_step_was_skipped",
    "prepare_optimizer",
    "unscale_gradients",
]


Params = torch.Tensor | Iterable[torch.Tensor]


class _StepRecorder:
    """Optimizer step post-hook, registered once: notes that the real ``step()`` ran."""

    __slots__ = ("target",)

    def __init__(self, target: PreparedOptimizer) -> None:
        self.target = weakref.ref(target)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        prepared = self.target()
        if prepared is not None:
            prepared.step_ran = True


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping only on sync steps and through the fp16 GradScaler.

    ``state``, ``param_groups``, ``defaults``, ``state_dict()``, ``load_state_dict()`` and
    ``add_param_group()`` act on the user's optimizer (:attr:`optimizer`); other attributes
    are looked up there too. Made by :func:`prepare_optimizer`. The mode's precision unit
    steps it (``accel.precision.base.StepRecord``: :attr:`scaler`, whether the last step was
    skipped, whether the gradients were unscaled since, whether the real step ran).

    Example:
        >>> optimizer = accel.prepare_optimizer(torch.optim.AdamW(model.parameters()))
        >>> isinstance(optimizer, torch.optim.Optimizer), optimizer.optimizer
        (True, AdamW (...))
    """

    def __init__(self, optimizer: Any, scaler: torch.amp.GradScaler | None) -> None:
        # torch.optim.Optimizer.__init__ is not called: this object holds no parameters.
        self.optimizer = optimizer
        self.scaler = scaler
        self.step_was_skipped = False
        self.step_ran = False
        self.grads_unscaled = False
        self.step_hook: Any = None
        if scaler is not None and isinstance(optimizer, torch.optim.Optimizer):
            # Once, at prepare time: lets step() tell a skipped step without patching.
            self.step_hook = optimizer.register_step_post_hook(_StepRecorder(self))

    # -- pass-throughs -------------------------------------------------------------------
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Any:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict."""
        result: dict[str, Any] = self.optimizer.state_dict()
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the user's optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the user's optimizer."""
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        try:
            inner = self.__dict__["optimizer"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        raise NotPicklableError(
            "A prepared optimizer cannot be pickled; save `optimizer.state_dict()` instead "
            "(or use `accel.save_state`)."
        )

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    # -- the hot path --------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the gradients, except while gradients are being accumulated."""
        ENGINES[state().strategy].zero_grad(self.optimizer, set_to_none, scope().sync_gradients)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the user's optimizer on sync steps (through the GradScaler under fp16).

        Under an N-D mesh the step runs with torch's ``implicit_replication``: a
        tensor-parallel model without FSDP keeps plain parameters (layers left whole, the same
        on every TP rank) beside DTensor ones, and a ``foreach`` optimizer step refuses the mix
        otherwise.
        """
        st = state()
        # the unit straight from the registry (the name was checked when the state was made):
        # this runs every step, and each Python call frame costs ~0.1 us
        return ENGINES[st.strategy].step(self, closure, st, scope().sync_gradients, layout_groups)


def _layouts(st: ProcessState) -> Layouts | None:
    """How the precision unit groups gradients by layout: only under an N-D mesh."""
    return layout_groups if st.mesh is not None else None


def _registry() -> list[weakref.ref[Any]]:
    return scope().optimizers


def _prepared_optimizers() -> list[PreparedOptimizer]:
    refs = scope().optimizers
    if not refs:
        return []
    return [opt for opt in (ref() for ref in refs) if isinstance(opt, PreparedOptimizer)]


def _find_prepared(optimizer: Any) -> PreparedOptimizer | None:
    if isinstance(optimizer, PreparedOptimizer):
        return optimizer
    for prepared in _prepared_optimizers():
        if prepared.optimizer is optimizer:
            return prepared
    return None


def _place_state(optimizer: Any, device: torch.device) -> None:
    opt_state = getattr(optimizer, "state", None)
    if not opt_state:
        return
    misplaced = any(
        isinstance(value, torch.Tensor) and value.device != device and value.dim() > 0
        for per_param in opt_state.values()
        for value in per_param.values()
    )
    if misplaced:  # load_state_dict casts the state to each parameter's device
        optimizer.load_state_dict(optimizer.state_dict())


def prepare_optimizer(optimizer: Any, *, device_placement: bool = True) -> PreparedOptimizer:
    """Wrap ``optimizer`` so it steps only on sync steps, through a GradScaler under fp16.

    ``step()`` and ``zero_grad()`` do nothing while gradients are being accumulated
    (``accel.sync_gradients()`` is ``False``). Under ``mixed_precision="fp16"`` the scope's
    :class:`torch.amp.GradScaler` (created here on the state's device type, CPU included)
    unscales the gradients, skips the step when they hold inf/nan, and updates the scale;
    :func:`optimizer_step_was_skipped` then reports it. Preparing the same optimizer twice in a
    scope returns the same wrapper.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (or an object with ``step``/``zero_grad``).
        device_placement: move existing optimizer state (e.g. loaded from a checkpoint) to the
            parameters' devices.

    Returns:
        A :class:`PreparedOptimizer` (a ``torch.optim.Optimizer``) around the user's one.

    Raises:
        TypeError: ``optimizer`` has no ``step``/``zero_grad``.
        StaleParametersError: it holds parameters that ``prepare_model(strategy="fsdp")``
            replaced (it was created before the model was sharded).

    Example:
        >>> optimizer = accel.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> accel.backward(model(x).sum()); optimizer.step(); optimizer.zero_grad()
    """
    existing = _find_prepared(optimizer)
    if existing is not None:
        return existing
    if not (callable(getattr(optimizer, "step", None))
            and callable(getattr(optimizer, "zero_grad", None))):
        raise ArgumentTypeError(
            f"prepare_optimizer expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__} {optimizer!r:.60}. Pass the optimizer, e.g. "
            "`accel.prepare_optimizer(torch.optim.AdamW(model.parameters()))`."
        )
    st = state()
    scaler = engine_for(st.strategy).optimizer_scaler(st)  # DeepSpeed's engine scales itself
    check_optimizer_parameters(optimizer)
    if device_placement:
        _place_state(optimizer, st.device)
    prepared = PreparedOptimizer(optimizer, scaler)
    refs = _registry()
    refs[:] = [ref for ref in refs if ref() is not None]
    refs.append(weakref.ref(prepared))
    return prepared


def optimizer_step_was_skipped(optimizer: Any) -> bool:
    """Whether the optimizer's last sync step was skipped (fp16 inf/nan gradients).

    Args:
        optimizer: a prepared optimizer (or the user's optimizer it wraps).

    Returns:
        ``True`` when the GradScaler skipped the last step; ``False`` otherwise and for
        optimizers that were not prepared.

    Example:
        >>> optimizer.step()
        >>> if accel.optimizer_step_was_skipped(optimizer):
        ...     print("overflow: step skipped, scale lowered")
    """
    prepared = _find_prepared(optimizer)
    return prepared is not None and prepared.step_was_skipped


# -- gradient unscaling and clipping ------------------------------------------------------
def _as_list(parameters: Params) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    items = list(parameters) if isinstance(parameters, Iterable) else [parameters]
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise ArgumentTypeError(
                f"Gradient clipping takes tensors (e.g. `model.parameters()`), got "
                f"{type(item).__name__} {item!r:.60}. Pass the parameters, e.g. "
                "`accel.clip_grad_norm_(model.parameters(), 1.0)`."
            )
    return items


def unscale_gradients(optimizer: Any = None) -> None:
    """Divide the fp16-scaled gradients by the loss scale, once per optimizer step.

    A no-op without an fp16 GradScaler, on non-sync steps (gradients are still being
    accumulated: unscaling them now would mix scaled and unscaled sums), and for an optimizer
    already unscaled since its last step. :func:`clip_grad_norm_` calls it for you.

    Args:
        optimizer: a prepared optimizer, the user's optimizer, or a list of them; ``None``
            unscales every optimizer prepared in this scope.

    Example:
        >>> accel.backward(loss)
        >>> accel.unscale_gradients(optimizer)
        >>> grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    """
    st = state()
    unit = precision_for(st.mixed_precision)
    if unit.active_scaler() is None or not scope().sync_gradients:
        return
    if optimizer is None:
        targets: list[Any] = _prepared_optimizers()
    elif isinstance(optimizer, list | tuple):
        targets = list(optimizer)
    else:
        targets = [optimizer]
    layouts = _layouts(st)
    for target in targets:
        # not prepared (None): the caller manages the scaler's stage
        unit.unscale(target, _find_prepared(target), layouts)


def clip_grad_norm_(
    parameters: Params, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients' total norm, unscaling fp16 gradients first (once per step).

    Use it in place of :func:`torch.nn.utils.clip_grad_norm_`; it works for DDP and FSDP2
    (DTensor) parameters alike: under FSDP2 the norm is taken over every rank's shards (a
    collective: call it on every rank) and returned as a plain tensor, the same on every
    rank. On a non-sync step (inside ``accel.accumulate`` while gradients are still being
    accumulated) it does not clip and returns the total norm of the gradients accumulated so
    far on this rank (in unscaled units). Accelerate clips
    those partial sums; accel does not, because the clip belongs to the gradient the
    optimizer will use, and unscaling a partial fp16 sum would break the GradScaler.

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` to clip.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).

    Returns:
        The total norm of the gradients before clipping (a tensor).

    Example:
        >>> accel.backward(loss)
        >>> norm = accel.clip_grad_norm_(model.parameters(), 1.0)
        >>> optimizer.step()
    """
    params = _as_list(parameters)
    return engine_for(state().strategy).clip_grad_norm(
        params, max_norm, norm_type, scope().sync_gradients, unscale_gradients
    )


def clip_grad_value_(parameters: Params, clip_value: float) -> None:
    """Clip every gradient element to ``[-clip_value, clip_value]``, unscaling fp16 first.

    Use it in place of :func:`torch.nn.utils.clip_grad_value_`. Like :func:`clip_grad_norm_`,
    it does nothing on a non-sync step.

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` to clip.
        clip_value: the largest absolute value allowed.

    Example:
        >>> accel.backward(loss)
        >>> accel.clip_grad_value_(model.parameters(), 0.5)
    """
    engine_for(state().strategy).clip_grad_value(
        _as_list(parameters), clip_value, scope().sync_gradients, unscale_gradients
    )

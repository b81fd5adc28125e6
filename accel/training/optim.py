"""Prepared optimizers, the fp16 GradScaler, and gradient clipping (schedulers: scheduling.py).

Where things live:

- whether the current batch is a sync step: ``accel.core.state.scope().sync_gradients`` (set by
  ``accel.accumulate``; ``True`` when no accumulation is used);
- the fp16 :class:`torch.amp.GradScaler`: ``scope().grad_scaler``, one per ``distributed()``
  scope, created by the first :func:`prepare_optimizer` under ``mixed_precision="fp16"``.
  It is used (by ``accel.backward``, prepared optimizers' ``step()``, unscaling and clipping
  alike) only while the state's policy is ``"fp16"``: a nested
  ``accel.distributed(mixed_precision="no")`` block trains without loss scaling.
  Save and restore it with :func:`scaler_state_dict` / :func:`load_scaler_state_dict`;
- the optimizers prepared in the scope: weak references in
  ``scope().optimizers`` (for :func:`unscale_gradients` with no argument and
  for schedulers to find their optimizer);
- per-optimizer facts (last step skipped, gradients already unscaled this step): attributes
  of the :class:`PreparedOptimizer`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import torch

from accel.core.state import ProcessState, scope, state
from accel.errors import ArgumentTypeError, NotPicklableError
from accel.parallel.fsdp_params import (
    check_optimizer_parameters,
    clip_by_total_norm,
    layout_groups,
)

__all__ = [
    "PreparedOptimizer",
    "active_scaler",
    "clip_grad_norm_",
    "clip_grad_value_",
    "load_scaler_state_dict",
    "optimizer_step_was_skipped",
    "prepare_optimizer",
    "scaler_state_dict",
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
            prepared._stepped = True


class PreparedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepping only on sync steps and through the fp16 GradScaler.

    ``state``, ``param_groups``, ``defaults``, ``state_dict()``, ``load_state_dict()`` and
    ``add_param_group()`` act on the user's optimizer (:attr:`optimizer`); other attributes
    are looked up there too. Made by :func:`prepare_optimizer`.

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
        self._stepped = False
        self._unscaled = False
        self._hook: Any = None
        if scaler is not None and isinstance(optimizer, torch.optim.Optimizer):
            # Once, at prepare time: lets step() tell a skipped step without patching.
            self._hook = optimizer.register_step_post_hook(_StepRecorder(self))

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
        if not scope().sync_gradients:
            return
        if set_to_none is None:
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Step the user's optimizer on sync steps (through the GradScaler under fp16).

        Under an N-D mesh the step runs with torch's ``implicit_replication``: a
        tensor-parallel model without FSDP keeps plain parameters (layers left whole, the same
        on every TP rank) beside DTensor ones, and a ``foreach`` optimizer step refuses the mix
        otherwise.
        """
        if not scope().sync_gradients:
            return None
        st = state()
        if st.mesh is not None:
            from torch.distributed.tensor.experimental import implicit_replication

            with implicit_replication():
                return self._step(closure, st)
        return self._step(closure, st)

    def _step(self, closure: Callable[[], float] | None, st: ProcessState) -> Any:
        scaler = self.scaler
        if scaler is None or st.mixed_precision != "fp16":
            if closure is None:
                return self.optimizer.step()
            return self.optimizer.step(closure)
        if st.mesh is not None:
            _agree_on_overflow(scaler, self.optimizer, unscaled=self._unscaled)
        if self._hook is not None:
            self._stepped = False
            result = scaler.step(self.optimizer) if closure is None else scaler.step(
                self.optimizer, closure
            )
            scaler.update()
            self.step_was_skipped = not self._stepped
        else:  # not a torch Optimizer (no hooks): a skipped step lowers the scale
            before = scaler.get_scale()
            result = scaler.step(self.optimizer) if closure is None else scaler.step(
                self.optimizer, closure
            )
            scaler.update()
            self.step_was_skipped = scaler.get_scale() < before
        self._unscaled = False
        return result


def mesh_unscale(scaler: torch.amp.GradScaler, optimizer: Any) -> None:
    """``scaler.unscale_(optimizer)``, also where gradients of several layouts sit together.

    A tensor-parallel model's optimizer holds plain gradients (layers left whole, the same on
    every TP rank) beside DTensor gradients on one or two meshes; torch's unscale takes one
    kind per call. Under an N-D mesh each layout group is unscaled on its own (with torch's
    own per-group step, so its overflow check reduces over the group's mesh) and the
    overflow flags are merged per device, as ``unscale_`` records them.

    Example:
        >>> mesh_unscale(scaler, optimizer)
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = layout_groups(params) if state().mesh is not None else []
    if len(groups) <= 1 or not scaler.is_enabled():
        scaler.unscale_(optimizer)
        return
    from torch.amp.grad_scaler import OptState

    record = scaler._per_optimizer_states[id(optimizer)]
    if record["stage"] is not OptState.READY:
        scaler.unscale_(optimizer)  # torch says what is wrong (unscaled twice, after step)
        return
    scale = scaler._scale
    assert scale is not None
    inv_scale = scale.double().reciprocal().float()
    found: dict[torch.device, torch.Tensor] = {}
    for group in groups:
        proxy = SimpleNamespace(param_groups=[{"params": group}])
        flag = torch.zeros((), dtype=torch.float32, device=scale.device)
        for device, value in scaler._unscale_grads_(
            proxy, inv_scale, flag, False  # type: ignore[arg-type]
        ).items():
            found[device] = value if device not in found else torch.maximum(found[device], value)
    record["found_inf_per_device"] = found
    record["stage"] = OptState.UNSCALED


def _agree_on_overflow(scaler: torch.amp.GradScaler, optimizer: Any, *, unscaled: bool) -> None:
    """Make every rank of an N-D mesh skip the step when any rank's gradients overflowed.

    Each rank checks only its own pieces of sharded gradients (an inf in one TP or FSDP shard
    is seen by one rank), and torch's check reduces over one mesh per call; without this, one
    rank would skip the step while the others took it. One all-reduce of one flag per fp16
    step, only under a mesh.
    """
    import torch.distributed as dist

    if not unscaled:
        mesh_unscale(scaler, optimizer)  # records found_inf per device (scaler.step reuses it)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    if not found:  # no gradient on this rank: torch's GradScaler.step refuses it next
        return
    values = list(found.values())
    flag = torch.stack([v.to(values[0].device).reshape(()) for v in values]).amax()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    for value in values:
        value.copy_(flag.to(value.device))


def active_scaler() -> torch.amp.GradScaler | None:
    """The scope's GradScaler while the policy is fp16, else ``None`` (the loss is unscaled).

    Example:
        >>> scaler = active_scaler()
        >>> scaled = loss if scaler is None else scaler.scale(loss)
    """
    scaler: torch.amp.GradScaler | None = scope().grad_scaler
    if scaler is None or state().mixed_precision != "fp16":
        return None
    return scaler


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
    sc = scope()
    scaler: torch.amp.GradScaler | None = None
    if st.mixed_precision == "fp16":
        scaler = sc.grad_scaler
        if scaler is None:
            scaler = sc.grad_scaler = torch.amp.GradScaler(st.device.type)
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


def scaler_state_dict() -> dict[str, Any] | None:
    """The scope's fp16 GradScaler state (scale, growth tracker...), or ``None`` if none.

    Example:
        >>> saved = scaler_state_dict()
        >>> load_scaler_state_dict(saved)  # later, e.g. after a restart
    """
    scaler = scope().grad_scaler
    if scaler is None:
        return None
    result: dict[str, Any] = scaler.state_dict()
    return result


def load_scaler_state_dict(state_dict: dict[str, Any] | None) -> None:
    """Restore the scope's fp16 GradScaler from :func:`scaler_state_dict`'s value.

    ``None`` or an empty dict (saved without fp16) leaves it as it is. When the scope has no
    scaler yet (no optimizer prepared under fp16), one is created on the state's device.

    Example:
        >>> load_scaler_state_dict(saved)
    """
    if not state_dict:
        return
    sc = scope()
    if sc.grad_scaler is None:
        sc.grad_scaler = torch.amp.GradScaler(state().device.type)
    sc.grad_scaler.load_state_dict(state_dict)


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
    sc = scope()
    scaler = active_scaler()
    if scaler is None or not sc.sync_gradients:
        return
    if optimizer is None:
        targets: list[Any] = _prepared_optimizers()
    elif isinstance(optimizer, list | tuple):
        targets = list(optimizer)
    else:
        targets = [optimizer]
    for target in targets:
        prepared = _find_prepared(target)
        if prepared is None:  # not prepared: the caller manages the scaler's stage
            mesh_unscale(scaler, target)
            continue
        if prepared.scaler is None or prepared._unscaled:
            continue
        mesh_unscale(prepared.scaler, prepared.optimizer)
        prepared._unscaled = True


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
    sc = scope()
    if not sc.sync_gradients:
        norm = clip_by_total_norm(params, None, norm_type)
        scaler = active_scaler()
        if scaler is not None and scaler.is_enabled():
            norm = norm / scaler.get_scale()
        return norm
    unscale_gradients()
    return clip_by_total_norm(params, max_norm, norm_type)


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
    if not scope().sync_gradients:
        return
    unscale_gradients()
    torch.nn.utils.clip_grad_value_(_as_list(parameters), clip_value)

"""Prepared LR schedulers: they step with their optimizer's real steps.

A prepared scheduler finds its optimizer among the scope's prepared optimizers
(``accel.training.optim``) and steps only when that optimizer really stepped (a sync step whose
update was not skipped for inf/nan gradients).
"""

from __future__ import annotations

from typing import Any

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from accel.core.global_batch import reference_world
from accel.core.scope import scope
from accel.core.state import state
from accel.errors import ArgumentTypeError
from accel.training.optim import PreparedOptimizer, _find_prepared

__all__ = ["PreparedScheduler", "prepare_scheduler"]


def _loader_splits_batches(loader: Any) -> bool:
    split = getattr(loader, "split_batches", None)
    if split is None:  # accel.data's PreparedDataLoader keeps it in its plan
        split = getattr(getattr(loader, "_plan", None), "split_batches", False)
    return bool(split)


class PreparedScheduler(LRScheduler):
    """The user's scheduler, stepping with its optimizer's real steps.

    ``state_dict()``, ``load_state_dict()``, ``get_last_lr()`` and other attributes act on
    the user's scheduler (:attr:`scheduler`). Made by :func:`prepare_scheduler`.

    Example:
        >>> scheduler = accel.prepare_scheduler(torch.optim.lr_scheduler.StepLR(opt, 10))
        >>> scheduler.get_last_lr() == scheduler.scheduler.get_last_lr()
        True
    """

    def __init__(
        self,
        scheduler: Any,
        *,
        step_with_optimizer: bool,
        split_batches: bool | None,
    ) -> None:
        # LRScheduler.__init__ is not called: this object holds no schedule of its own.
        self.scheduler = scheduler
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches
        self._per_batch = not isinstance(scheduler, ReduceLROnPlateau)
        self._optimizer: PreparedOptimizer | None = _find_prepared(
            getattr(scheduler, "optimizer", None)
        )

    def __getattr__(self, name: str) -> Any:
        try:
            inner = self.__dict__["scheduler"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"PreparedScheduler({self.scheduler!r})"

    def state_dict(self) -> dict[str, Any]:
        """The user's scheduler's state dict."""
        result: dict[str, Any] = self.scheduler.state_dict()
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the user's scheduler."""
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[Any]:
        """The user's scheduler's last learning rates."""
        result: list[Any] = self.scheduler.get_last_lr()
        return result

    def get_lr(self) -> list[Any]:
        """The user's scheduler's ``get_lr()``."""
        result: list[Any] = self.scheduler.get_lr()
        return result

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the schedule if the optimizer really stepped (see :func:`prepare_scheduler`)."""
        scheduler = self.scheduler
        if not self.step_with_optimizer:
            scheduler.step(*args, **kwargs)
            return
        sc = scope()
        if not sc.sync_gradients:
            return
        optimizer = self._optimizer
        if optimizer is None:  # prepared before its optimizer: look again
            optimizer = self._optimizer = _find_prepared(getattr(scheduler, "optimizer", None))
        if optimizer is not None and optimizer.step_was_skipped:
            return
        split = self.split_batches
        if split is None:
            loaders = sc.active_loaders
            split = _loader_splits_batches(loaders[-1]) if loaders else False
        st = state()
        # keep_global_batch: a restart on another world size keeps the reference world's rule
        repeats = 1 if split or not self._per_batch else (
            reference_world(st.options) or st.world_size
        )
        for _ in range(repeats):
            total = getattr(scheduler, "total_steps", None)
            if total is not None and scheduler.last_epoch >= total:
                break  # OneCycleLR-style: stepping past total_steps would raise
            scheduler.step(*args, **kwargs)


def prepare_scheduler(
    scheduler: Any,
    *,
    step_with_optimizer: bool = True,
    split_batches: bool | None = None,
) -> PreparedScheduler:
    """Wrap ``scheduler`` so it advances with its optimizer's real steps.

    ``step()`` does nothing on non-sync steps (gradient accumulation) and when the optimizer's
    last step was skipped (fp16 overflow).

    **IMPORTANT — it advances ``world_size`` scheduler steps per optimizer step** when batches
    are not split (``split_batches=False``, the default of prepared data loaders). This is
    Accelerate's rule, on purpose: with N processes each optimizer step consumes N batches
    (one per rank), so the loader has N times fewer steps per epoch than in a single process.
    A schedule written for the single-process number of batches (``total_steps=len(loader) *
    epochs`` computed before ``prepare``) therefore still finishes on time. With
    ``split_batches=True`` each step consumes one global batch and the scheduler steps once.
    Under ``keep_global_batch=R`` (elastic jobs) it advances ``R`` steps whatever the world
    size, so a restart on fewer processes keeps the schedule.
    Schedulers with ``total_steps`` (``OneCycleLR``) stop at the end instead of raising when a
    last partial round would step past it. ``ReduceLROnPlateau`` (stepped with a metric, not
    per batch) steps once.

    Args:
        scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` built on the optimizer (the
            user's or the prepared one).
        step_with_optimizer: ``False`` makes ``step()`` a plain, unconditional step.
        split_batches: whether each batch is split across the ranks; ``None`` reads the
            ``split_batches`` of the innermost prepared loader being iterated (``False`` when
            none is).

    Returns:
        A :class:`PreparedScheduler` (an ``LRScheduler``) around the user's one.

    Example:
        >>> scheduler = accel.prepare_scheduler(
        ...     torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=len(loader))
        ... )
    """
    if isinstance(scheduler, PreparedScheduler):
        return scheduler
    if not callable(getattr(scheduler, "step", None)):
        raise ArgumentTypeError(
            f"prepare_scheduler expects a torch.optim.lr_scheduler.LRScheduler, got "
            f"{type(scheduler).__name__} {scheduler!r:.60}. Pass the scheduler, e.g. "
            "`accel.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 10))`."
        )
    return PreparedScheduler(
        scheduler, step_with_optimizer=step_with_optimizer, split_batches=split_batches
    )

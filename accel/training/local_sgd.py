"""LocalSGD: train on each rank without gradient sync, average the parameters every k steps.

``with accel.LocalSGD(model=model, local_sgd_steps=8) as local_sgd:`` turns DDP's gradient
all-reduce off for the whole block (``model.no_sync()``), so every rank takes its own optimizer
steps on its own data; ``local_sgd.step()`` counts calls and, every ``local_sgd_steps`` calls,
replaces each trainable parameter by its mean over the ranks; leaving the block normally
averages once more. It is HuggingFace Accelerate's ``LocalSGD`` without the ``accelerator``
argument.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.comm.collectives import begin
from accel.core.state import state
from accel.errors import ConfigError
from accel.parallel.engines.registry import ENGINES, engine_for
from accel.training.accumulation import no_sync
from accel.training.model import _prepared_result

__all__ = ["LocalSGD"]

# Parameters are averaged in buckets of about this size (one all_reduce per bucket): fewer,
# larger messages than one per parameter, and never a second full copy of a large model.
_BUCKET_BYTES = 32 * 1024 * 1024
# Half-precision parameters are summed in float32, so the mean is not rounded world_size times.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_steps(local_sgd_steps: object, enabled: bool) -> int | None:
    if local_sgd_steps is None and not enabled:
        return None  # Accelerate's example passes `local_sgd_steps=None, enabled=False`
    if (
        isinstance(local_sgd_steps, bool)
        or not isinstance(local_sgd_steps, int)
        or local_sgd_steps < 1
    ):
        raise ConfigError(
            f"LocalSGD(local_sgd_steps={local_sgd_steps!r}): it must be a positive int, the "
            "number of `local_sgd.step()` calls between two parameter averagings, e.g. "
            "`accel.LocalSGD(model=model, local_sgd_steps=8)` (`None` only with "
            "`enabled=False`)."
        )
    return local_sgd_steps


def _is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds only shards of its parameters (FSDP2's ``fully_shard`` or
    FSDP1's wrapper): every engine is asked."""
    return any(engine.is_sharded(module) for engine in ENGINES.values())


def _resolve_model(model: object) -> nn.Module:
    """The module to train with: the prepared result of ``model``, or ``model`` itself."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"LocalSGD(model=...) expects a torch.nn.Module, got {type(model).__name__!r} "
            f"({model!r:.80}). Pass the model you train, prepared or not, e.g. "
            "`accel.LocalSGD(model=model, local_sgd_steps=8)` after "
            "`model = accel.prepare_model(model)`."
        )
    prepared = _prepared_result(model)  # the original module of a prepared model works too
    return prepared if prepared is not None else model


def _refuse_sharding(model: nn.Module, strategy: str) -> None:
    engine_shards = engine_for(strategy).shards_parameters
    if engine_shards or _is_sharded(model):
        what = f"strategy={strategy!r}" if engine_shards else f"{type(model).__name__!r}"
        raise ConfigError(
            f"LocalSGD supports replicated models only (one process, or DDP with strategy "
            f"'none'/'ddp'), but got an FSDP-sharded setup ({what}): each rank holds only "
            "shards, so there is no local copy to train and average, as in Accelerate. Use "
            "`accel.distributed(strategy='ddp')` for LocalSGD, or drop LocalSGD under FSDP."
        )


def _buckets(params: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``params`` with one device and dtype, each about ``_BUCKET_BYTES``.

    The split depends only on the parameters' order, shapes, dtypes and devices, so every rank
    of a replicated model makes the same buckets and the same all_reduce calls.
    """
    bucket: list[torch.Tensor] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if bucket and (
            param.dtype != bucket[0].dtype
            or param.device != bucket[0].device
            or size + nbytes > _BUCKET_BYTES
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(param)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def _average_parameters(params: Sequence[torch.Tensor], world_size: int) -> None:
    """Replace each tensor of ``params`` in place by its mean over the ranks (a collective)."""
    for bucket in _buckets(params):
        dtype = bucket[0].dtype
        work_dtype = torch.float32 if dtype in _LOW_PRECISION else dtype
        flat = torch.cat([p.detach().reshape(-1).to(work_dtype) for p in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)
        offset = 0
        for param in bucket:
            count = param.numel()
            param.detach().copy_(flat[offset : offset + count].view_as(param))
            offset += count


class LocalSGD:
    """Local SGD: no gradient sync in the block; parameters averaged every k ``step()`` calls.

    Inside the ``with`` block a DDP model does not all-reduce gradients (its ``no_sync()`` is
    held for the whole block, also on the sync steps of :func:`accel.accumulate` inside it), so
    each rank's optimizer steps on its own gradients and the replicas drift apart. Every
    ``local_sgd_steps``-th call of :meth:`step` replaces each trainable parameter by its mean
    over all ranks, and leaving the block normally averages once more, so every rank leaves it
    with the same weights. Only trainable parameters (``requires_grad=True``) are averaged;
    buffers (e.g. BatchNorm running statistics) and frozen parameters are left as they are, as
    in Accelerate. Half-precision parameters are summed in float32.

    With ``enabled=False``, or on a single process, it does nothing: gradients are synchronised
    as usual and :meth:`step` only counts. A block left by an exception makes no collective
    (the rank leaves at once; parameters are not averaged). Refused under FSDP sharding.

    Args:
        model: the model trained in the block: the prepared model (DDP, compiled or not) or
            the module given to :func:`accel.prepare_model`; a plain module on several
            processes is averaged too (it has no gradient sync to turn off).
        local_sgd_steps: number of :meth:`step` calls between two averagings (a positive int;
            may be ``None`` when ``enabled=False``).
        enabled: ``False`` makes the whole object a no-op.

    Raises:
        ConfigError: ``local_sgd_steps`` not a positive int, ``enabled`` not a bool, ``model``
            not a module, or an FSDP strategy or sharded model.

    Example:
        >>> with accel.LocalSGD(model=model, local_sgd_steps=8) as local_sgd:
        ...     for x, y in loader:
        ...         with accel.accumulate(model):
        ...             accel.backward(loss_fn(model(x), y))
        ...             optimizer.step()
        ...             optimizer.zero_grad()
        ...             local_sgd.step()
    """

    def __init__(
        self, model: nn.Module, local_sgd_steps: int | None, *, enabled: bool = True
    ) -> None:
        if not isinstance(enabled, bool):
            raise ConfigError(
                f"LocalSGD(enabled={enabled!r}): it must be True or False, e.g. "
                "`accel.LocalSGD(model=model, local_sgd_steps=8, "
                "enabled=local_sgd_steps is not None)`."
            )
        steps = _check_steps(local_sgd_steps, enabled)
        target = _resolve_model(model)
        st = state()
        _refuse_sharding(target, st.strategy)
        #: whether it averages (``enabled`` and more than one process)
        self.enabled: bool = enabled and st.world_size > 1
        #: calls of :meth:`step` so far
        self.num_steps: int = 0
        self.model: nn.Module = target
        self.local_sgd_steps: int | None = steps
        self._no_sync: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:  # DDP's no_sync, also through torch.compile (accel.no_sync)
            context = no_sync(self.model)
            context.__enter__()
            self._no_sync = context
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        context, self._no_sync = self._no_sync, None
        try:
            if self.enabled and exc_type is None:
                self._average()
        finally:
            if context is not None:
                context.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Count one step; every ``local_sgd_steps``-th call averages the parameters.

        Call it on every rank the same number of times (an averaging call is a collective);
        Accelerate's place for it is right after ``optimizer.zero_grad()``.

        Raises:
            GatedCollectiveError: an averaging call inside a rank-gated function or block.

        Example:
            >>> optimizer.step(); optimizer.zero_grad()
            >>> local_sgd.step()
        """
        self.num_steps += 1
        if not self.enabled:
            return
        period = self.local_sgd_steps  # an int whenever enabled (checked in __init__)
        if period is not None and self.num_steps % period == 0:
            self._average()

    def _average(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        st = begin("LocalSGD.step", params)
        if st is not None:
            _average_parameters(params, st.world_size)

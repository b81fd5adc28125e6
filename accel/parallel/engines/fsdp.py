"""The FSDP2 engine (``strategy="fsdp"``): the model sharded in place with torch's
``fully_shard`` (``accel.parallel.fsdp`` holds its options and the sharding itself).

Example:
    >>> with accel.distributed(strategy="fsdp"):
    ...     model = accel.prepare_model(net)   # sharded over the data-parallel ranks
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any, ClassVar

import attrs
from torch import nn

from accel.core.options import BlockChoice
from accel.core.state import ProcessState
from accel.parallel.blockwise import checkpoint_blocks
from accel.parallel.engines.base import Engine, Placed
from accel.parallel.fsdp_params import set_gradient_sync

__all__ = ["FSDP"]


@attrs.frozen
class FSDP(Engine):
    """``strategy="fsdp"``: parameters, gradients and optimizer state sharded by FSDP2.

    Example:
        >>> engine_for("fsdp").shards_parameters
        True
    """

    name: ClassVar[str] = "fsdp"
    shards_parameters: ClassVar[bool] = True

    def stage_options(self, st: ProcessState, given: Mapping[str, Any]) -> dict[str, Any]:
        return dict(given)

    def under_tensor_parallel(self, st: ProcessState, evaluation_mode: bool) -> str:
        return self.name

    def place(
        self, model: nn.Module, st: ProcessState, given: Mapping[str, Any], *,
        checkpointing: BlockChoice, evaluation_mode: bool, device_placement: bool,
    ) -> Placed:
        from accel.parallel import fsdp  # torch.distributed.fsdp loads only for this engine

        sharding = fsdp.fsdp_options(st.options, given)
        if checkpointing is not False:  # before sharding: FSDP's hooks stay outside
            checkpoint_blocks(model, checkpointing, shard_modules=sharding.shard_modules)
        model = fsdp.shard_model(
            model, sharding, evaluation_mode=evaluation_mode, device_placement=device_placement
        )
        return Placed(model, sharding.shard_modules, None)

    def wrap(self, placed: Placed, st: ProcessState, evaluation_mode: bool) -> nn.Module:
        return placed.model  # sharded in place: no wrapper

    def is_sharded(self, module: nn.Module) -> bool:
        if _is_fsdp2(module):
            return True
        fsdp = sys.modules.get("torch.distributed.fsdp")  # FSDP1's wrapper, if it was loaded
        wrapper = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
        return wrapper is not None and isinstance(module, wrapper)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        return _GradientSync(model, False) if _is_fsdp2(model) else None

    def sync_on(self, model: nn.Module) -> contextlib.AbstractContextManager[Any] | None:
        return _GradientSync(model, True) if _is_fsdp2(model) else None


def _is_fsdp2(model: nn.Module) -> bool:
    return getattr(type(model), "set_requires_gradient_sync", None) is not None


class _GradientSync:
    """Set FSDP2's gradient-sync flag for the block (a class: cheaper than a generator).

    FSDP2 has no getter for the flag; its default (and the state outside these blocks) is
    True, so both blocks leave it True.
    """

    __slots__ = ("_model", "_requires_sync")

    def __init__(self, model: nn.Module, requires_sync: bool) -> None:
        self._model = model
        self._requires_sync = requires_sync

    def __enter__(self) -> None:
        set_gradient_sync(self._model, self._requires_sync)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._requires_sync:
            set_gradient_sync(self._model, True)

"""The prepared loader: one ``DataLoader`` class, one small mode object per way of sharding.

:class:`PreparedDataLoader` owns what every mode shares: the position (epoch and batches
yielded, shared with ``skip_first_batches`` views), the seeds, device placement and the
per-batch loop that keeps ``end_of_dataloader``, ``final_round`` and ``remainder`` up to
date. What differs between modes sits in a :class:`LoaderMode`, chosen once by
``prepare_data_loader``: :class:`~accel.data._shard_mode.ShardMode` (map-style datasets, a
sharded batch sampler), :class:`~accel.data._stream_mode.StreamMode` (iterable datasets read by
every rank) and :class:`~accel.data._dispatch_mode.DispatchMode` (rank 0 reads, broadcasts).

While iterating, the loader is registered in ``accel.core.scope.scope().active_loaders``
(innermost last) for :func:`accel.gather_for_metrics` and ``accel.accumulate``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal, Protocol

import attrs
import torch
from torch.utils.data import DataLoader

from accel.comm.metrics import FinalRound
from accel.core.scope import scope
from accel.core.tree import map_tensors
from accel.data._epoch_seeds import Reseeder, WorkerSeeds
from accel.data._loader_state import loader_state, read_loader_state
from accel.data._resume_checks import Restored, warn_earlier_epoch

__all__ = ["LoaderMode", "Plan", "PreparedDataLoader", "loader_options"]

Mode = Literal["shard", "stream", "dispatch"]


class LoaderMode(Protocol):
    """What differs between the shard, stream and dispatch modes of a prepared loader."""

    @property
    def ragged(self) -> bool:
        """Batch sizes may differ between ranks in any round (variable-size batch sampler)."""
        ...

    def length(self, loader: PreparedDataLoader) -> int:
        """Batches of this rank in a whole epoch."""
        ...

    def epoch_batches(self, loader: PreparedDataLoader, epoch: int, start: int) -> Iterator[Any]:
        """This rank's batches of ``epoch`` from batch ``start`` on (not yet on the device)."""
        ...

    def final_round(self) -> FinalRound | None:
        """The last round of the epoch just iterated, when known."""
        ...

    def shuffle(self) -> Reseeder | None:
        """The reseeder that owns the shuffle's generator, or ``None`` without a shuffle."""
        ...

    def set_even(self, value: bool) -> None:
        """Apply a new ``even_batches`` to the epoch being iterated, where it matters."""
        ...


@attrs.define(eq=False)
class _Cursor:
    """Position shared by a loader and its ``skip_first_batches`` views."""

    epoch: int = 0
    yielded: int = 0
    pending: bool = True  # (epoch, yielded) is where the next iteration starts
    restored: Restored | None = None  # what load_state_dict restored, until the next iteration
    done: bool = False  # the last batch of `epoch` was yielded (a position at the epoch's end)


@attrs.frozen(kw_only=True)
class Plan:
    """The facts every mode shares, fixed when the loader is prepared.

    Example:
        >>> Plan(mode="shard", world_size=2, batch_size=4, split_batches=False, device=None,
        ...      non_blocking=False).world_size
        2
    """

    mode: Mode
    world_size: int
    batch_size: int | None  # None: variable-size batches
    split_batches: bool
    device: torch.device | None  # None: no device placement
    non_blocking: bool


_END = object()


def _move_to(device: torch.device, non_blocking: bool, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device, non_blocking=non_blocking)


def loader_options(loader: DataLoader[Any]) -> dict[str, Any]:
    """The original loader's options that the prepared loader keeps.

    Example:
        >>> loader_options(DataLoader(range(4), num_workers=0))["num_workers"]
        0
    """
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": torch.Generator(),  # worker seeds: reseeded per epoch, see WorkerSeeds
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": getattr(loader, "pin_memory_device", ""),
    }
    if hasattr(loader, "in_order"):
        options["in_order"] = loader.in_order
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return options


class PreparedDataLoader(DataLoader[Any]):
    """A ``DataLoader`` yielding this rank's shard of batches on the state's device.

    Made by :func:`accel.prepare_data_loader`; do not construct it directly. Besides the
    ``DataLoader`` interface it has ``epoch``, ``set_epoch(e)``, ``state_dict()`` /
    ``load_state_dict()``, ``total_batch_size``, and while iterating ``end_of_dataloader``,
    ``final_round`` and ``remainder``.

    Example:
        >>> loader = accel.prepare_data_loader(DataLoader(range(8), batch_size=2))
        >>> isinstance(loader, DataLoader), len(loader)
        (True, 2)  # on 2 processes
    """

    end_of_dataloader: bool
    remainder: int
    final_round: FinalRound | None

    def __init__(
        self,
        dataset: Any,
        *,
        plan: Plan,
        mode: LoaderMode,
        worker_seeds: WorkerSeeds,
        even_batches: bool,
        **options: Any,
    ) -> None:
        super().__init__(dataset, **options)
        self.worker_seeds = worker_seeds
        self._plan = plan
        self._mode = mode
        self._cursor = _Cursor()
        self._skip_once: int | None = None
        self._move: Callable[[Any], Any] | None = None
        if plan.device is not None and plan.device.type != "cpu" and plan.mode != "dispatch":
            self._move = partial(map_tensors, partial(_move_to, plan.device, plan.non_blocking))
        self._even_batches = even_batches
        #: batch sizes may differ between ranks in any round (variable-size batch sampler)
        self.ragged_batches = mode.ragged
        self.end_of_dataloader = False
        self.remainder = -1
        self.final_round = None

    # ---------------------------------------------------------------- position

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or the one the next iteration will use."""
        cursor = self._cursor
        return cursor.epoch

    @property
    def device(self) -> torch.device | None:
        """Where batches are placed (``None`` without device placement)."""
        return self._plan.device

    @property
    def split_batches(self) -> bool:
        """Whether each original batch is cut into ``world_size`` slices."""
        return self._plan.split_batches

    @property
    def even_batches(self) -> bool:
        """Whether the last round is completed by cycling (map-style datasets only).

        Setting it also applies to the epoch being iterated, if its end is not reached yet.
        Inside ``accel.join_uneven_inputs(..., even_batches=...)`` an iteration that starts
        uses the block's value instead.
        """
        return self._even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self._even_batches = bool(value)
        self._mode.set_even(bool(value))

    @property
    def total_batch_size(self) -> int | None:
        """Samples per step over all ranks (``None`` for variable-size batches)."""
        size = self._plan.batch_size
        if size is None:
            return None
        return size if self._plan.split_batches else size * self._plan.world_size

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (new shuffle), from its first batch.

        A position restored by :meth:`load_state_dict` for the same epoch is kept.

        Example:
            >>> for epoch in range(3):
            ...     loader.set_epoch(epoch)
            ...     for batch in loader: ...
        """
        cursor = self._cursor
        if not (cursor.pending and cursor.epoch == epoch):
            cursor.epoch, cursor.yielded, cursor.pending = int(epoch), 0, True
            cursor.done = False

    def state_dict(self) -> dict[str, int | None]:
        """The exact position and seeds: everything needed to continue the same order.

        ``epoch`` and ``batches_yielded`` (on this rank) with the world size and batch
        splitting they were counted with (so another number of processes can re-derive the
        position), ``epoch_done`` (1 once the epoch's last batch was yielded: any number of
        processes continues with the next epoch), ``shuffle_seed`` (``None`` without a
        shuffle of the loader's own) and ``worker_seed``: the same on every rank.

        Example:
            >>> loader.state_dict()
            {'epoch': 1, 'batches_yielded': 3, 'world_size': 2, 'split_batches': 0,
             'shuffle_seed': 8262917305619414281, 'worker_seed': 8262917305619414281,
             'epoch_done': 0}
        """
        cursor, plan, shuffle = self._cursor, self._plan, self._mode.shuffle()
        return loader_state(
            cursor.epoch, cursor.yielded, world_size=plan.world_size,
            split_batches=plan.split_batches, worker_seed=self.worker_seeds.base,
            shuffle_seed=None if shuffle is None else shuffle.seed, epoch_done=cursor.done,
        )

    def load_state_dict(self, state_dict: dict[str, int | None]) -> None:
        """Resume at a state from :meth:`state_dict`: the next iteration continues it.

        The saved seeds replace the loader's own, so this epoch and the next ones have the
        saved run's order whatever the global RNG was when this loader was prepared (a state
        without seeds keeps the loader's own). Skipped batches are skipped by index
        (map-style datasets) without loading them.

        Raises:
            CheckpointError: The dictionary is not a loader state.

        Example:
            >>> loader.load_state_dict({"epoch": 1, "batches_yielded": 3})
            >>> next(iter(loader))  # batch 3 of epoch 1
        """
        plan = self._plan
        saved = read_loader_state(
            state_dict, world_size=plan.world_size, split_batches=plan.split_batches
        )
        shuffle = self._mode.shuffle()
        if shuffle is not None and saved.shuffle_seed is not None:
            shuffle.seed = saved.shuffle_seed
        if saved.worker_seed is not None:
            self.worker_seeds.base = saved.worker_seed
        cursor = self._cursor
        epoch, yielded = saved.epoch, saved.yielded
        if saved.epoch_done and yielded == 0:  # an epoch's end, saved at another world size
            try:
                yielded = self._mode.length(self)  # this world's whole epoch
            except TypeError:  # an unsized stream: the next epoch from its start
                epoch, saved = epoch + 1, attrs.evolve(saved, epoch_done=False)
        cursor.epoch, cursor.yielded, cursor.pending = epoch, yielded, True
        cursor.restored, cursor.done = Restored(epoch, yielded), saved.epoch_done

    def _begin(self) -> tuple[int, int]:
        cursor = self._cursor
        if cursor.pending:
            epoch, start = cursor.epoch, cursor.yielded
        else:
            epoch, start = cursor.epoch + 1, 0
        restored, cursor.restored = cursor.restored, None
        if restored is not None and epoch < restored.epoch:
            warn_earlier_epoch(restored, epoch, stacklevel=3)  # _begin < __iter__ < the loop
        if self._skip_once is not None:
            start, self._skip_once = self._skip_once, None
        cursor.epoch, cursor.yielded, cursor.pending = epoch, start, False
        cursor.done = False
        return epoch, start

    # ---------------------------------------------------------------- iteration

    def __len__(self) -> int:
        length = self._mode.length(self)
        return length if self._skip_once is None else max(0, length - self._skip_once)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch, start = self._begin()
        return self._run(self._mode.epoch_batches(self, epoch, start), epoch)

    def _run(self, source: Iterator[Any], epoch: int) -> Iterator[Any]:
        cursor = self._cursor
        move = self._move
        loaders = scope().active_loaders
        self.end_of_dataloader = False
        self.remainder = -1
        self.final_round = None
        loaders.append(self)
        try:
            batch = next(source, _END)
            if batch is _END:
                cursor.epoch, cursor.yielded, cursor.pending = epoch + 1, 0, True
                return
            while True:
                if move is not None:
                    batch = move(batch)
                upcoming = next(source, _END)
                if upcoming is _END:
                    break
                cursor.yielded += 1
                yield batch
                batch = upcoming
            final = self._mode.final_round()
            self.final_round = final
            self.remainder = -1 if final is None else final.remainder
            self.end_of_dataloader = True
            cursor.yielded += 1
            cursor.done = True
            yield batch
            cursor.epoch, cursor.yielded, cursor.pending = epoch + 1, 0, True
            cursor.done = False
        finally:
            for index in range(len(loaders) - 1, -1, -1):
                if loaders[index] is self:
                    del loaders[index]
                    break

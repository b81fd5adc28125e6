"""Prepared data loaders: per-rank shards, device placement, epochs and exact resume.

:func:`prepare_data_loader` returns a :class:`PreparedDataLoader`, a real
``torch.utils.data.DataLoader`` built from the original's options, that yields this rank's
batches (Accelerate's sharding rules, see :mod:`accel._sharding`) on the state's device.

Shuffling: a random sampler gets its own generator, seeded with a seed shared by all ranks
plus the epoch, so every rank draws the same permutation and each epoch a new one. The shared
seed is rank 0's sampler generator's seed when the user gave one, else ``state().seed``, else
a seed drawn on rank 0; it is broadcast while preparing unless it is ``state().seed`` (every
rank must prepare the loader, as with every ``prepare_*``). Samplers, batch samplers and
datasets with ``set_epoch`` are told the epoch. A new iteration starts a new epoch;
``set_epoch(e)`` chooses it.

While iterating, the loader is registered in ``accel._state.scope().active_loaders`` (innermost
last) and keeps ``end_of_dataloader`` (the batch just yielded is the last),
``final_round`` (:class:`~accel._sharding.FinalRound` of the last round, on the last batch) and
``remainder`` (real samples in the final global batch, ``-1`` when unknown) up to date, for
:func:`accel.gather_for_metrics`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

import attrs
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from accel._dispatch import concat_rounds, dispatch_rounds
from accel._epochs import WorkerSeeds, seeded_copy, stream_reseeder, worker_seeds
from accel._resume import loader_state, read_loader_state, shuffle_reseeder
from accel._sharding import FinalRound, Reseeder, ShardedBatchSampler, ShardSpec, StreamShard
from accel._state import scope, state
from accel._tree import map_tensors
from accel.errors import ConfigError
from accel.errors import DataLoaderTypeError as DataLoaderTypeError

__all__ = ["PreparedDataLoader", "prepare_data_loader", "skip_first_batches"]

Mode = Literal["shard", "stream", "dispatch"]


# --------------------------------------------------------------------------- the loader


@attrs.define(eq=False)
class _Cursor:
    """Position shared by a loader and its ``skip_first_batches`` views."""

    epoch: int = 0
    yielded: int = 0
    pending: bool = True  # (epoch, yielded) is where the next iteration starts


@attrs.frozen(kw_only=True)
class _Plan:
    mode: Mode
    rank: int
    world_size: int
    batch_size: int | None
    split_batches: bool
    drop_last: bool
    device: torch.device | None
    non_blocking: bool


_END = object()


def _move_to(device: torch.device, non_blocking: bool, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device, non_blocking=non_blocking)


def _loader_options(loader: DataLoader[Any]) -> dict[str, Any]:
    """The original loader's options that the prepared loader keeps."""
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

    Made by :func:`prepare_data_loader`; do not construct it directly. Besides the
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
        plan: _Plan,
        sharded: ShardedBatchSampler | None = None,
        stream: StreamShard | None = None,
        base: DataLoader[Any] | None = None,
        worker_seeds: WorkerSeeds,
        **options: Any,
    ) -> None:
        super().__init__(dataset, **options)
        self.worker_seeds = worker_seeds
        self._plan = plan
        self._sharded = sharded
        self._stream = stream
        self._base = base
        self._cursor = _Cursor()
        self._skip_once: int | None = None
        self._move: Callable[[Any], Any] | None = None
        if plan.device is not None and plan.device.type != "cpu" and plan.mode != "dispatch":
            self._move = partial(map_tensors, partial(_move_to, plan.device, plan.non_blocking))
        self._dispatch_final: FinalRound | None = None
        self._even_batches = True if sharded is None else sharded.even_batches
        #: batch sizes may differ between ranks in any round (variable-size batch sampler)
        self.ragged_batches = (
            sharded is not None and sharded.spec.batch_size is None and plan.world_size > 1
        )
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
        if self._sharded is not None:
            self._sharded.even_batches = bool(value)

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

    def state_dict(self) -> dict[str, int | None]:
        """The exact position and seeds: everything needed to continue the same order.

        ``epoch`` and ``batches_yielded`` (on this rank) with the world size and batch
        splitting they were counted with (so another number of processes can re-derive the
        position), ``shuffle_seed`` (``None`` without a shuffle of the loader's own) and
        ``worker_seed``: the same on every rank.

        Example:
            >>> loader.state_dict()
            {'epoch': 1, 'batches_yielded': 3, 'world_size': 2, 'split_batches': 0,
             'shuffle_seed': 8262917305619414281, 'worker_seed': 8262917305619414281}
        """
        cursor, plan, shuffle = self._cursor, self._plan, self._shuffle()
        return loader_state(
            cursor.epoch, cursor.yielded, world_size=plan.world_size,
            split_batches=plan.split_batches, worker_seed=self.worker_seeds.base,
            shuffle_seed=None if shuffle is None else shuffle.seed,
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
        shuffle = self._shuffle()
        if shuffle is not None and saved.shuffle_seed is not None:
            shuffle.seed = saved.shuffle_seed
        if saved.worker_seed is not None:
            self.worker_seeds.base = saved.worker_seed
        cursor = self._cursor
        cursor.epoch, cursor.yielded, cursor.pending = saved.epoch, saved.yielded, True

    def _shuffle(self) -> Reseeder | None:
        base = self._base
        held = () if base is None else (base.batch_sampler, base.sampler, base.dataset)
        return shuffle_reseeder(self._sharded, self._stream, *held)

    def _begin(self) -> tuple[int, int]:
        cursor = self._cursor
        if cursor.pending:
            epoch, start = cursor.epoch, cursor.yielded
        else:
            epoch, start = cursor.epoch + 1, 0
        if self._skip_once is not None:
            start, self._skip_once = self._skip_once, None
        cursor.epoch, cursor.yielded, cursor.pending = epoch, start, False
        return epoch, start

    # ---------------------------------------------------------------- iteration

    def __len__(self) -> int:
        plan = self._plan
        if plan.mode == "shard":
            assert self._sharded is not None
            length = len(self._sharded)
        elif plan.mode == "stream":
            length = super().__len__()
        else:
            assert self._base is not None
            whole = len(self._base)
            if plan.split_batches:
                length = whole
            elif plan.drop_last:
                length = whole // plan.world_size
            else:
                length = math.ceil(whole / plan.world_size)
        return length if self._skip_once is None else max(0, length - self._skip_once)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch, start = self._begin()
        plan = self._plan
        if plan.mode == "dispatch":
            return self._run(self._dispatch(epoch, start), epoch)
        if self._sharded is not None:
            from accel.uneven import EVEN_BATCHES_KEY

            override = scope().extras.get(EVEN_BATCHES_KEY)
            even = self._even_batches if override is None else bool(override)
            self._sharded.epoch, self._sharded.skip = epoch, start
            self._sharded.even_batches = even
        if self._stream is not None:
            self._stream.skip = start * (self._stream.per_rank)
            self._stream.reseed(epoch)
        self.worker_seeds.apply(self.generator, epoch)
        return self._run(super().__iter__(), epoch)

    def _final(self) -> FinalRound | None:
        if self._sharded is not None:
            return self._sharded.final_round
        if self._stream is not None:
            return self._stream.final_round or self._stream.expected_final_round()
        return self._dispatch_final

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
            final = self._final()
            self.final_round = final
            self.remainder = -1 if final is None else final.remainder
            self.end_of_dataloader = True
            cursor.yielded += 1
            yield batch
            cursor.epoch, cursor.yielded, cursor.pending = epoch + 1, 0, True
        finally:
            for index in range(len(loaders) - 1, -1, -1):
                if loaders[index] is self:
                    del loaders[index]
                    break

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, epoch: int, start: int) -> Iterator[Any]:
        """All ranks: rank 0 reads whole rounds and broadcasts them; each keeps its slice."""
        plan = self._plan
        assert plan.device is not None
        group = 1 if plan.split_batches else plan.world_size
        rounds: Iterator[Any] = iter(())
        if plan.rank == 0:
            rounds = self._base_rounds(epoch, start * group, group)
        self._dispatch_final = None
        return dispatch_rounds(
            rounds, rank=plan.rank, world_size=plan.world_size, device=plan.device,
            resume=start > 0, record=self._record_dispatch,
        )

    def _record_dispatch(self, final: FinalRound) -> None:
        self._dispatch_final = final

    def _base_rounds(self, epoch: int, skip: int, group: int) -> Iterator[Any]:
        """Rank 0: the base loader's batches, ``group`` at a time, concatenated.

        When resuming (``skip > 0``) the first round is still read (its first samples pad
        the last round, as in an uninterrupted epoch), then ``skip`` batches are skipped.
        """
        base = self._base
        assert base is not None
        keep = group if skip else 0
        skip -= keep
        sampler = base.batch_sampler
        if not isinstance(sampler, ShardedBatchSampler):
            sampler = base.sampler
        if isinstance(sampler, ShardedBatchSampler):
            sampler.epoch, sampler.skip, sampler.keep = epoch, skip, keep
        dataset = base.dataset
        if isinstance(dataset, StreamShard):
            dataset.skip = skip * dataset.per_rank
            dataset.keep = keep * dataset.per_rank
            dataset.reseed(epoch)
        self.worker_seeds.apply(base.generator, epoch)
        return concat_rounds(iter(base), group, drop_last=self._plan.drop_last)


# --------------------------------------------------------------------------- public API


def _batch_size_of(loader: DataLoader[Any]) -> int | None:
    if loader.batch_size is not None:
        return loader.batch_size
    holder = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    size = getattr(holder, "batch_size", None)
    return size if isinstance(size, int) else None


def prepare_data_loader(
    loader: DataLoader[Any],
    *,
    device_placement: bool = True,
    split_batches: bool = False,
    even_batches: bool = True,
    dispatch_batches: bool | None = None,
) -> DataLoader[Any]:
    """Shard a ``DataLoader`` for this rank and place its batches on the state's device.

    Every rank must call it (it may broadcast seeds). Batch ``i`` of the original
    loader goes to rank ``i % world_size``; with ``split_batches`` every batch is cut into
    ``world_size`` slices instead. ``even_batches`` (map-style datasets) completes the last
    round with samples from the start of the epoch so every rank gets the same number of
    batches; iterable datasets are always completed unless ``drop_last``. With
    ``even_batches=False`` ranks may get different numbers of batches: collectives in the loop
    (``gather_for_metrics`` included) then hang on the ranks that still have one.

    ``dispatch_batches=None`` means ``True`` for an ``IterableDataset`` with device placement
    (Accelerate's default), else ``False``: rank 0 reads each round, broadcasts it, and every
    rank keeps its slice. Preparing a prepared loader returns it unchanged.

    The result is a plain ``DataLoader`` subclass rebuilt from the original's options (a
    ``DataLoader`` subclass's own behaviour is not kept); it never draws from the global RNG.
    Resuming (``load_state_dict``, :func:`skip_first_batches`) skips map-style batches by
    index; an iterable dataset's skipped elements are read and dropped, and with
    ``persistent_workers`` its workers keep the epoch and skip of their first epoch (as
    PyTorch's ``set_epoch`` on such datasets). As with PyTorch, an ``IterableDataset`` read
    by several workers must split itself between them (``get_worker_info``).

    Args:
        loader: The loader to shard; its options (workers, collate_fn, pinning...) are kept.
        device_placement: Move every tensor of each batch to ``accel.state().device``.
        split_batches: Cut each batch in ``world_size`` parts (the batch size must divide).
        even_batches: Complete the last round by cycling (map-style datasets).
        dispatch_batches: Read on rank 0 and broadcast (needs ``device_placement``).

    Returns:
        A :class:`PreparedDataLoader` (a ``torch.utils.data.DataLoader``).

    Raises:
        ConfigError: Incompatible options (see the message for the fix).

    Example:
        >>> loader = accel.prepare_data_loader(DataLoader(range(21), batch_size=3))
        >>> [b.tolist() for b in loader][-1]
        [18, 19, 20]  # rank 0
        [0, 1, 2]     # rank 1
    """
    if isinstance(loader, PreparedDataLoader):
        return loader
    if not isinstance(loader, DataLoader):
        raise DataLoaderTypeError(
            f"prepare_data_loader() needs a torch.utils.data.DataLoader, got "
            f"{type(loader).__name__} {loader!r:.60}. Wrap the dataset: "
            "`accel.prepare_data_loader(DataLoader(dataset, batch_size=...))`."
        )
    st = state()
    rank, world = st.rank, st.world_size
    dataset = loader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if dispatch_batches is None:
        dispatch_batches = iterable and device_placement
    if dispatch_batches and not device_placement:
        raise ConfigError(
            "dispatch_batches=True broadcasts batches from rank 0 on the device, so it needs "
            "device_placement=True; got device_placement=False. Use "
            "`prepare_data_loader(loader, dispatch_batches=False)`."
        )
    batch_size = _batch_size_of(loader)
    if split_batches and (batch_size is None or batch_size % world != 0):
        raise ConfigError(
            f"split_batches=True cuts every batch into {world} equal slices, but the batch "
            f"size is {batch_size!r}, not a multiple of {world}. Use a batch size that is a "
            "multiple of the number of processes, or `split_batches=False`."
        )
    if iterable and batch_size is None:
        raise ConfigError(
            "prepare_data_loader() needs batches of an iterable dataset to shard it, but the "
            "loader has batch_size=None. Use `DataLoader(dataset, batch_size=...)`."
        )
    device = st.device if device_placement else None
    pin = bool(loader.pin_memory)
    plan = _Plan(
        mode="dispatch" if dispatch_batches and world > 1 else ("stream" if iterable else "shard"),
        rank=rank,
        world_size=world,
        batch_size=batch_size,
        split_batches=split_batches,
        drop_last=bool(loader.drop_last),
        device=device,
        non_blocking=pin and device is not None and device.type == "cuda",
    )
    options = _loader_options(loader)
    options["worker_seeds"] = worker_seeds(loader, rank)
    if plan.mode == "dispatch":
        base = _base_loader(loader, options)
        if iterable:
            return PreparedDataLoader(
                base.dataset, plan=plan, base=base, batch_size=batch_size,
                drop_last=plan.drop_last, **options,
            )
        if base.batch_sampler is None:
            return PreparedDataLoader(
                base.dataset, plan=plan, base=base, sampler=base.sampler, batch_size=None,
                **options,
            )
        return PreparedDataLoader(
            base.dataset, plan=plan, base=base, batch_sampler=base.batch_sampler, **options
        )
    if iterable:
        assert batch_size is not None
        per_rank = batch_size // world if split_batches else batch_size
        stream = StreamShard(
            dataset, rank=rank, world_size=world, per_rank=per_rank, drop_last=plan.drop_last
        )
        stream.reseed = stream_reseeder(dataset, shared=True)
        return PreparedDataLoader(
            stream, plan=plan, stream=stream, batch_size=per_rank,
            drop_last=plan.drop_last, **options,
        )
    sharded = _sharded_sampler(loader, plan, even_batches=even_batches, shared=True)
    if loader.batch_sampler is None:  # a BatchSampler given as `sampler` (batch_size=None)
        return PreparedDataLoader(
            dataset, plan=plan, sharded=sharded, sampler=sharded, batch_size=None, **options
        )
    return PreparedDataLoader(dataset, plan=plan, sharded=sharded, batch_sampler=sharded, **options)


def _sharded_sampler(
    loader: DataLoader[Any], plan: _Plan, *, even_batches: bool, shared: bool
) -> ShardedBatchSampler:
    source: Any = loader.batch_sampler
    if source is None:
        if not isinstance(loader.sampler, BatchSampler):
            raise ConfigError(
                "prepare_data_loader() shards batches, but this loader has batch_size=None "
                "(no batching) and a sampler of single indices. Use `DataLoader(dataset, "
                "batch_size=...)` or pass a `BatchSampler` as `batch_sampler`."
            )
        source = loader.sampler
    batch_sampler, reseed = seeded_copy(source, loader.dataset, shared=shared)
    size = getattr(batch_sampler, "batch_size", None)
    spec = ShardSpec(
        rank=plan.rank,
        world_size=plan.world_size,
        batch_size=size if isinstance(size, int) else None,
        drop_last=bool(getattr(batch_sampler, "drop_last", False)),
        split_batches=plan.split_batches,
        even_batches=even_batches,
    )
    return ShardedBatchSampler(batch_sampler, spec, reseed)


def _base_loader(loader: DataLoader[Any], options: dict[str, Any]) -> DataLoader[Any]:
    """The unsharded loader rank 0 reads in dispatch mode (seeded per epoch, skips cheaply).

    Its shuffle seed is rank 0's on every rank, so every rank's ``state_dict()`` agrees.
    """
    options = {key: value for key, value in options.items() if key != "worker_seeds"}
    options["generator"] = torch.Generator()
    single = _Plan(
        mode="shard", rank=0, world_size=1, batch_size=loader.batch_size, split_batches=False,
        drop_last=bool(loader.drop_last), device=None, non_blocking=False,
    )
    if isinstance(loader.dataset, IterableDataset):
        assert loader.batch_size is not None
        stream = StreamShard(
            loader.dataset, rank=0, world_size=1, per_rank=loader.batch_size,
            drop_last=bool(loader.drop_last),
        )
        stream.reseed = stream_reseeder(loader.dataset, shared=True)
        return DataLoader(
            stream, batch_size=loader.batch_size, drop_last=bool(loader.drop_last), **options
        )
    sharded = _sharded_sampler(loader, single, even_batches=True, shared=True)
    if loader.batch_sampler is None:
        return DataLoader(loader.dataset, sampler=sharded, batch_size=None, **options)
    return DataLoader(loader.dataset, batch_sampler=sharded, **options)


def skip_first_batches(
    loader: DataLoader[Any], num_batches: int, *, epoch: int | None = None
) -> DataLoader[Any]:
    """A loader whose next iteration starts at batch ``num_batches`` of an epoch.

    Without ``epoch`` it is the loader's current epoch (epoch 0 in a fresh process, so when
    resuming a run whose loader was not saved pass ``epoch``, or the first epoch's shuffle is
    replayed). With ``epoch`` it is that epoch, set as ``loader.set_epoch(epoch)`` does: the
    result yields exactly what the loader yields for that epoch from batch ``num_batches`` on.
    For a prepared loader the result shares its epoch counter (the epoch after this one is
    the next epoch) and skips by index without loading the skipped batches (iterable datasets
    must still read the skipped elements). Later iterations of the result are whole epochs.
    ``len()`` of the result is the number of remaining batches until it is iterated.

    Args:
        loader: A loader from :func:`prepare_data_loader`.
        num_batches: Batches of this rank to skip.
        epoch: The epoch to resume (its shuffle); default the loader's current one.

    Raises:
        DataLoaderTypeError: ``loader`` is not a prepared loader.
        ConfigError: ``num_batches`` or ``epoch`` is negative or not an integer.

    Example:
        >>> resumed = accel.skip_first_batches(loader, 3, epoch=2)
        >>> for batch in resumed: ...  # batches 3, 4, ... of epoch 2
    """
    if not isinstance(loader, PreparedDataLoader):
        raise DataLoaderTypeError(
            f"skip_first_batches() needs a prepared loader, got {type(loader).__name__}. "
            "Prepare it first: `accel.skip_first_batches(accel.prepare_data_loader(loader), n)`."
        )
    for name, value in (("num_batches", num_batches), ("epoch", epoch)):
        if name == "epoch" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"{name}={value!r} must be a non-negative integer, e.g. "
                "`accel.skip_first_batches(loader, 3, epoch=1)`."
            )
    view = copy.copy(loader)
    view.__dict__["_iterator"] = None  # its own (persistent) worker iterator
    view.__dict__["_skip_once"] = num_batches
    if epoch is not None:
        view.set_epoch(epoch)  # the shared cursor: the loader's next epoch is epoch + 1
    return view

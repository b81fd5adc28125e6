"""Prepared data loaders: per-rank shards, device placement, epochs and exact resume.

:func:`prepare_data_loader` returns a :class:`~accel.data._loader.PreparedDataLoader`, a real
``torch.utils.data.DataLoader`` built from the original's options, that yields this rank's
batches (Accelerate's sharding rules, see :mod:`accel.data._batch_sampler`) on the state's
device. It chooses the loader's mode once: shard (map-style datasets,
:mod:`accel.data._shard_mode`), stream (iterable datasets, :mod:`accel.data._stream_mode`) or
dispatch (rank 0 reads and broadcasts, :mod:`accel.data._dispatch_mode`).

Shuffling: a random sampler gets its own generator, seeded with a seed shared by all ranks
plus the epoch, so every rank draws the same permutation and each epoch a new one. The shared
seed is rank 0's sampler generator's seed when the user gave one, else ``state().seed``, else
a seed drawn on rank 0; it is broadcast while preparing unless it is ``state().seed`` (every
rank must prepare the loader, as with every ``prepare_*``). Samplers, batch samplers and
datasets with ``set_epoch`` are told the epoch. A new iteration starts a new epoch;
``set_epoch(e)`` chooses it.

While iterating, the loader is registered in ``accel.core.scope.scope().active_loaders`` (innermost
last) and keeps ``end_of_dataloader`` (the batch just yielded is the last),
``final_round`` (:class:`~accel.comm.metrics.FinalRound` of the last round, on the last batch) and
``remainder`` (real samples in the final global batch, ``-1`` when unknown) up to date, for
:func:`accel.gather_for_metrics`.
"""

from __future__ import annotations

import copy
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from accel.core.state import state
from accel.data._dispatch_mode import dispatch_map, dispatch_stream
from accel.data._epoch_seeds import worker_seeds
from accel.data._loader import LoaderMode, Plan, PreparedDataLoader, loader_options
from accel.data._resume_checks import warn_skip_after_restore
from accel.data._shard_mode import shard_mode
from accel.data._stream_mode import stream_mode
from accel.errors import ConfigError, DataLoaderTypeError

__all__ = ["PreparedDataLoader", "prepare_data_loader", "skip_first_batches"]


def _batch_size_of(loader: DataLoader[Any]) -> int | None:
    if loader.batch_size is not None:
        return loader.batch_size
    holder = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    size = getattr(holder, "batch_size", None)
    return size if isinstance(size, int) else None


def _iterable_batch_size(batch_size: int | None) -> int:
    if batch_size is None:
        raise ConfigError(
            "prepare_data_loader() needs batches of an iterable dataset to shard it, but the "
            "loader has batch_size=None. Use `DataLoader(dataset, batch_size=...)`."
        )
    return batch_size


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
    plan = _plan(loader, device_placement, split_batches, dispatch_batches)
    options = loader_options(loader)
    seeds = worker_seeds(loader, state().dp_rank)
    mode, arguments = _mode(loader, plan, options, even_batches)
    return PreparedDataLoader(
        plan=plan, mode=mode, worker_seeds=seeds,
        even_batches=even_batches if plan.mode == "shard" else True, **arguments, **options,
    )


def _plan(
    loader: DataLoader[Any], device_placement: bool, split_batches: bool,
    dispatch_batches: bool | None,
) -> Plan:
    """The loader's mode and how its batches are cut and placed; the options checked."""
    st = state()
    world = st.dp_world_size  # a tensor-parallel group shares its batches
    iterable = isinstance(loader.dataset, IterableDataset)
    if dispatch_batches is None:
        dispatch_batches = iterable and device_placement
    if dispatch_batches and not device_placement:
        raise ConfigError(
            "dispatch_batches=True broadcasts batches from rank 0 on the device, so it needs "
            "device_placement=True; got device_placement=False. Use "
            "`prepare_data_loader(loader, dispatch_batches=False)`."
        )
    batch_size = _batch_size_of(loader)
    if split_batches and st.options.get("keep_global_batch") is not None:
        raise ConfigError(
            f"split_batches=True with keep_global_batch={st.options['keep_global_batch']!r}: "
            "split batches already keep the global batch at any world size (each batch is cut "
            "over the ranks), so scaling the accumulation steps would change it. Drop "
            "keep_global_batch, or prepare the loader with `split_batches=False`."
        )
    if split_batches and (batch_size is None or batch_size % world != 0):
        raise ConfigError(
            f"split_batches=True cuts every batch into {world} equal slices, but the batch "
            f"size is {batch_size!r}, not a multiple of {world}. Use a batch size that is a "
            "multiple of the number of processes, or `split_batches=False`."
        )
    device = st.device if device_placement else None
    return Plan(
        mode="dispatch" if dispatch_batches and world > 1 else ("stream" if iterable else "shard"),
        world_size=world,
        batch_size=batch_size,
        split_batches=split_batches,
        device=device,
        non_blocking=bool(loader.pin_memory) and device is not None and device.type == "cuda",
    )


def _mode(
    loader: DataLoader[Any], plan: Plan, options: dict[str, Any], even_batches: bool
) -> tuple[LoaderMode, dict[str, Any]]:
    """The :class:`LoaderMode` for ``plan.mode`` and the loader arguments it sets."""
    st = state()
    rank, world, split = st.dp_rank, plan.world_size, plan.split_batches
    if isinstance(loader.dataset, IterableDataset):
        size = _iterable_batch_size(plan.batch_size)
        if plan.mode == "dispatch":
            return dispatch_stream(
                loader, options, batch_size=size, rank=rank, world_size=world,
                device=st.device, split_batches=split,
            )
        return stream_mode(
            loader, batch_size=size, rank=rank, world_size=world, split_batches=split,
        )
    if plan.mode == "dispatch":
        return dispatch_map(
            loader, options, rank=rank, world_size=world, device=st.device, split_batches=split,
        )
    return shard_mode(
        loader, rank=rank, world_size=world, split_batches=split, even_batches=even_batches,
    )


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
    restored = loader._cursor.restored
    if restored is not None and restored.yielded > 0:  # a restored mid-epoch position skips
        loader._cursor.restored = None  # said once per restore
        warn_skip_after_restore(restored, num_batches, epoch, stacklevel=2)
    view = copy.copy(loader)
    view.__dict__["_iterator"] = None  # its own (persistent) worker iterator
    view.__dict__["_skip_once"] = num_batches
    if epoch is not None:
        view.set_epoch(epoch)  # the shared cursor: the loader's next epoch is epoch + 1
    return view

"""Per-epoch seeds of prepared loaders: one shuffle on every rank, a new one each epoch.

Nothing here draws from the global RNG while iterating, so a resumed run replays the same
epochs: samplers get their own generator reseeded with ``seed + epoch``, and the generator from
which ``DataLoader`` draws its worker seeds is reseeded per epoch and rank.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch
from torch.utils.data import DataLoader

from accel.core.state import state

__all__ = [
    "Reseeder", "WorkerSeeds", "epoch_seed", "seeded_copy", "stream_reseeder", "worker_seeds",
]


@attrs.define(eq=False)
class Reseeder:
    """Per epoch: reseed the sampler's generator with ``seed + epoch`` and call ``set_epoch``.

    ``seed + epoch`` wraps modulo ``2**64`` (as ``torch.Generator.manual_seed`` reads negative
    seeds), so any seed a generator can hold works for every epoch.

    Example:
        >>> Reseeder(torch.Generator(), 7, (sampler,))(2)  # seed 9, sampler.set_epoch(2)
    """

    generator: torch.Generator | None
    seed: int
    targets: tuple[Any, ...]

    def __call__(self, epoch: int) -> None:
        if self.generator is not None:
            self.generator.manual_seed((self.seed + epoch) % 2**64)  # a generator's range
        for target in self.targets:
            target.set_epoch(epoch)


def epoch_seed(own: object, *, shared: bool) -> int:
    """The base shuffle seed: the user's generator's, else ``state().seed``, else random.

    Unless it came from ``state().seed`` (the same everywhere), rank 0's seed is broadcast
    when every rank must shuffle alike (``shared``; a collective then).

    Example:
        >>> epoch_seed(torch.Generator().manual_seed(5), shared=False)
        5
    """
    st = state()
    if isinstance(own, torch.Generator):
        seed = own.initial_seed()
    elif st.seed is not None:
        return int(st.seed)
    else:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    if shared and st.world_size > 1:
        from accel.comm.collectives import broadcast_object

        seed = int(broadcast_object(seed))
    return seed


def stream_reseeder(dataset: Any, *, shared: bool) -> Reseeder:
    """Per epoch: ``dataset.set_epoch(e)``, else reseed its ``generator`` attribute (every
    rank reads the whole stream, so all must draw the same order; Accelerate's rule).

    Example:
        >>> stream_reseeder(dataset, shared=True)(epoch)  # before each epoch
    """
    if callable(getattr(dataset, "set_epoch", None)):
        return Reseeder(None, 0, (dataset,))
    own = getattr(dataset, "generator", None)
    if isinstance(own, torch.Generator):
        return Reseeder(own, epoch_seed(own, shared=shared), ())
    return Reseeder(None, 0, ())


def seeded_copy(batch_sampler: Any, dataset: Any, *, shared: bool) -> tuple[Any, Reseeder]:
    """Copy the batch sampler (and its random sampler) so the copy has its own generator.

    Returns the copy and the :class:`Reseeder` to call before each epoch
    (it also calls ``set_epoch`` on the sampler, batch sampler and dataset that have one).

    Example:
        >>> batches, reseed = seeded_copy(loader.batch_sampler, loader.dataset, shared=True)
        >>> reseed(3)  # then iterate `batches` for epoch 3
    """
    batch_sampler = copy.copy(batch_sampler)
    inner = getattr(batch_sampler, "sampler", None)
    generator: torch.Generator | None = None
    seed = 0
    if inner is not None and hasattr(inner, "generator"):
        inner = copy.copy(inner)
        batch_sampler.sampler = inner
        seed = epoch_seed(inner.generator, shared=shared)
        generator = torch.Generator()
        inner.generator = generator
    targets = tuple(
        obj
        for obj in (inner, batch_sampler, dataset)
        if obj is not None and callable(getattr(obj, "set_epoch", None))
    )
    return batch_sampler, Reseeder(generator, seed, targets)


@attrs.define
class WorkerSeeds:
    """Reseeds a loader's own generator each epoch, from which ``DataLoader`` draws the
    worker seeds: the user's global RNG is never consumed (exact resume) and each epoch,
    rank and resume of it draws the same seeds. ``base`` is the same on every rank and is
    part of the loader's state (restoring it changes it in place, for every view).

    Example:
        >>> WorkerSeeds(base=7, rank=1).apply(loader.generator, epoch=2)
    """

    base: int
    rank: int

    def apply(self, generator: torch.Generator, epoch: int) -> None:
        generator.manual_seed((self.base + 1_000_003 * epoch + 7_919 * self.rank) % 2**63)


def worker_seeds(loader: DataLoader[Any], rank: int) -> WorkerSeeds:
    """The worker seeds of a loader: from its generator's seed, else ``state().seed``, else
    rank 0's random draw (once, while preparing; broadcast, a collective then).

    Example:
        >>> worker_seeds(DataLoader(range(4), generator=torch.Generator().manual_seed(3)), 0)
        WorkerSeeds(base=3, rank=0)
    """
    own = loader.generator
    if isinstance(own, torch.Generator):
        return WorkerSeeds(own.initial_seed(), rank)
    return WorkerSeeds(epoch_seed(None, shared=True), rank)

"""Warnings where a resume silently goes wrong: a restored loader position overridden.

A loader restored by ``load_state_dict`` (what ``accel.load_state(..., train_loader=...)``
does) already starts at the saved batch of the saved epoch. Two habits of Accelerate scripts
drop that position without an error: keeping the script's own ``skip_first_batches(...)``
on a position restored mid-epoch (its count replaces the restored one; a position at the
start of an epoch, such as an Accelerate sampler's epoch, still needs it), and an epoch loop
that starts at 0 again (``set_epoch(0)`` replays epoch 0's order). Each is said once per
restore, as a ``UserWarning`` naming the restored position and the fix.
"""

from __future__ import annotations

import warnings

import attrs

__all__ = ["Restored", "warn_earlier_epoch", "warn_skip_after_restore"]


@attrs.frozen
class Restored:
    """The position a loader's ``load_state_dict`` restored, until its next iteration.

    Example:
        >>> Restored(epoch=2, yielded=5)
        Restored(epoch=2, yielded=5)
    """

    epoch: int
    yielded: int


def warn_skip_after_restore(
    restored: Restored, num_batches: int, epoch: int | None, *, stacklevel: int
) -> None:
    """Say that ``skip_first_batches`` overrides the position ``load_state_dict`` restored.

    Example:
        >>> warn_skip_after_restore(Restored(1, 3), 3, None, stacklevel=2)  # a UserWarning
    """
    call = f"skip_first_batches(loader, {num_batches}" + (
        ")" if epoch is None else f", epoch={epoch})"
    )
    warnings.warn(
        f"{call} was called on a loader whose position was restored by load_state_dict "
        f"(`accel.load_state(..., train_loader=loader)`): restored at epoch {restored.epoch}, "
        f"batch {restored.yielded}. The restored position already skips the batches done; "
        f"the skip replaces it (an Accelerate script's own resume skip counts them a second "
        f"time). Drop the `{call}` and iterate the restored loader itself.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def warn_earlier_epoch(restored: Restored, epoch: int, *, stacklevel: int) -> None:
    """Say that a restored loader is iterated at an epoch before the one it was saved in.

    Example:
        >>> warn_earlier_epoch(Restored(2, 0), 0, stacklevel=2)  # a UserWarning
    """
    warnings.warn(
        f"A loader restored by load_state_dict at epoch {restored.epoch}, batch "
        f"{restored.yielded} is iterated at epoch {epoch}: the restored position is dropped "
        f"and epoch {epoch}'s order is replayed (loader.set_epoch({epoch}) was called after "
        f"the restore). Start the epoch loop at the restored epoch: read `start = "
        f"loader.epoch` right after `accel.load_state(...)`, then `for epoch in range(start, "
        f"num_epochs): loader.set_epoch(epoch)` (set_epoch of the saved epoch keeps the "
        f"position).",
        UserWarning,
        stacklevel=stacklevel + 1,
    )

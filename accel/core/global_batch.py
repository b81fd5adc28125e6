"""Keeping the global batch when the world size changes (``keep_global_batch``).

An elastic job (``accel launch --nnodes MIN:MAX --max-restarts K``) may restart on fewer or
more machines than it started with. With ``keep_global_batch=R`` the script's
``gradient_accumulation_steps`` (and its per-rank batch size) are those of a world of ``R``
processes; at world size ``W`` the accumulation steps become ``steps * R / W``, so every
optimizer step still consumes ``R * steps`` per-rank batches: with batch ``i`` on rank
``i % W``, world 2 x accumulation 1 and world 1 x accumulation 2 consume the same batches per
optimizer step and average the same gradient (``loss / steps`` summed, the DDP mean). A world
size that cannot keep it (``R * steps`` not a multiple of ``W``) is refused, naming both sizes.

``accel.distributed()`` applies it when it resolves the policy, so
``accel.state().gradient_accumulation_steps`` is the scaled value everywhere (``accumulate``,
``backward``, the engines); the reference stays in ``accel.state().options`` for the
scheduler (:mod:`accel.training.scheduling` steps ``R`` times per optimizer step instead of
``W``, so the schedule does not change with the world size).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from accel.errors import ConfigError

__all__ = ["KEY", "keep_global_batch", "reference_world", "scaled_accumulation"]

KEY = "keep_global_batch"
"""The option's name (``distributed()`` keyword, config key, ``ACCEL_KEEP_GLOBAL_BATCH``)."""


def reference_world(options: Mapping[str, Any]) -> int | None:
    """The world size ``keep_global_batch`` names in ``options``, or ``None`` when unset.

    Raises:
        ConfigError: the value is not a whole number >= 1.

    Example:
        >>> reference_world({"keep_global_batch": 4}), reference_world({})
        (4, None)
    """
    value = options.get(KEY)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"keep_global_batch={value!r} is invalid; it must be the world size (a whole "
            "number of processes >= 1) that gradient_accumulation_steps is written for, e.g. "
            "`accel.distributed(keep_global_batch=4)` or `accel launch --keep-global-batch`."
        )
    return value


def scaled_accumulation(steps: int, *, reference: int, world_size: int) -> int:
    """The accumulation steps that keep ``reference * steps`` batches per optimizer step.

    Args:
        steps: ``gradient_accumulation_steps`` as written for ``reference`` processes.
        reference: the world size the steps are written for.
        world_size: the world size of this run.

    Returns:
        ``steps * reference // world_size``.

    Raises:
        ConfigError: ``steps * reference`` is not a multiple of ``world_size``; the message
            names both world sizes and the sizes that would keep the global batch.

    Example:
        >>> scaled_accumulation(1, reference=4, world_size=2)
        2
    """
    batches = steps * reference
    if batches % world_size:
        fits = [w for w in range(1, batches + 1) if batches % w == 0]
        raise ConfigError(
            f"keep_global_batch={reference}: the global batch of {reference} processes x "
            f"gradient_accumulation_steps={steps} ({batches} per-rank batches per optimizer "
            f"step) cannot be kept at world size {world_size}: {batches} is not a multiple of "
            f"{world_size}. Run on a world size among {fits}, or change "
            "gradient_accumulation_steps or keep_global_batch."
        )
    return batches // world_size


def keep_global_batch(
    policy: Mapping[str, Any], options: Mapping[str, Any], *, world_size: int, rank: int,
    given: bool = True,
) -> dict[str, Any]:
    """``policy`` with its accumulation steps scaled for ``world_size`` (unchanged without
    ``keep_global_batch`` in ``options``, or when ``given`` is False: already scaled).

    The main process says on stderr when the steps change (a restart on another world size).

    Raises:
        ConfigError: the option is invalid, or the world size cannot keep the global batch.

    Example:
        >>> keep_global_batch({"gradient_accumulation_steps": 1}, {"keep_global_batch": 2},
        ...                   world_size=1, rank=0)["gradient_accumulation_steps"]
        2
    """
    reference = reference_world(options)
    out = dict(policy)
    if reference is None or not given:
        return out
    steps = int(out["gradient_accumulation_steps"])
    scaled = scaled_accumulation(steps, reference=reference, world_size=world_size)
    if scaled != steps and rank == 0:
        sys.stderr.write(
            f"accel: keep_global_batch={reference}: world size {world_size}, "
            f"gradient_accumulation_steps {steps} -> {scaled} (the global batch of "
            f"{reference} processes is kept)\n"
        )
    out["gradient_accumulation_steps"] = scaled
    return out

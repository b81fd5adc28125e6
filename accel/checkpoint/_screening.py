"""Screening a root's numbered checkpoints before ``load_state`` verifies them one by one.

Verifying a candidate ends with a collective (every rank must agree before it falls back to the
next one), so a root holding many candidates that fail (100,000 ``checkpoint_N`` directories,
empty or with broken manifests, from a crash loop or planted in a shared directory) cost one
collective each: minutes on two ranks. :func:`screen` reads every candidate's manifest on every
rank first, which is cheap, and agrees on those that cannot load with one collective; only the
others are verified in full, newest first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from accel.checkpoint.layout import read_manifest
from accel.comm.collectives import gather_object
from accel.core.state import state
from accel.errors import CheckpointError

__all__ = ["listed", "missing_objects", "screen"]

_SHOWN = 10  # skipped checkpoints named in a message; the others are counted
_MESSAGE = 1000  # characters of each rank's reason carried to the others


def missing_objects(path: Path, saved: list[str], wanted: Iterable[str]) -> CheckpointError | None:
    """The error for objects the checkpoint at ``path`` (holding ``saved``) lacks, if any."""
    missing = [name for name in wanted if name not in saved]
    if not missing:
        return None
    return CheckpointError(
        f"The checkpoint at {os.fspath(path)!r} holds {saved}, not {missing}. Pass the "
        "names the objects were saved under."
    )


def screen(
    names: list[str], wanted: list[str], describe: Callable[[BaseException], str]
) -> dict[int, str]:
    """``{index: note}`` of the candidates (in ``names``) that cannot load: a manifest some
    rank cannot read, or lacking a ``wanted`` object. Every rank must call it (one collective)
    and gets the same answer.
    """
    mine: list[tuple[int, str]] = []
    for index, name in enumerate(names):
        try:
            manifest = read_manifest(Path(name))
            problem = missing_objects(Path(name), list(manifest["objects"]), wanted)
            if problem is not None:
                raise problem
        except Exception as exc:  # every rank must hear of it, not wait for a timeout
            mine.append((index, describe(exc)[:_MESSAGE]))
    several = state().world_size > 1
    failed: dict[int, list[str]] = {}
    for rank, report in enumerate(gather_object(mine)):
        for index, message in report:
            failed.setdefault(index, []).append(f"rank {rank}: {message}" if several else message)
    return {index: f"{names[index]}: {' | '.join(dict.fromkeys(messages))}"
            for index, messages in failed.items()}


def listed(notes: list[str]) -> str:
    """``notes`` joined for a message: the first few, then how many more there are."""
    more = len(notes) - _SHOWN
    return "; ".join(notes[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")

"""Every rank passes ``save_state`` / ``load_state`` the same arguments, or every rank is told.

Each rank reduces its call to a compact *signature* (the directory as an absolute path, the
step, the object names and kinds, the options) and carries it, with the argument error it met
if any, on the first collective those functions already make (``save_state``: the gather that
agrees on the temporary directory; ``load_state``: the gather of the candidates each writer
found). No collective is added, and a rank whose own arguments are invalid still makes that
collective, so the others are told instead of waiting for it. :func:`settle` then decides from
the same gathered list on every rank: a mismatch is a :class:`CheckpointError` naming each
rank's values, before anything is written or loaded.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from torch import nn

from accel.comm.collectives import gather_object
from accel.comm.failures import describe
from accel.errors import CheckpointError
from accel.training.model import unwrap_model

__all__ = ["Call", "agreed_target", "call_of", "settle"]

_SHOWN = 8  # distinct values named per argument; more are counted
_AGREED = {
    "save_state": "directory, step, objects (names and kinds) and options",
    "load_state": "directory, objects (names and kinds) and options",
}


@attrs.frozen
class Call:
    """One rank's call: its signature (argument name, value as text) and its argument error.

    ``machine`` is the rank's ``node_rank`` when it reads or writes its machine's own copy
    (``on_each_node=True``): its directory may then name another disk on each machine, and is
    compared with the other ranks of its machine only.
    """

    signature: tuple[tuple[str, str], ...]
    problem: str | None = None
    machine: int | None = None


def _directory(directory: object) -> str:
    if isinstance(directory, str | os.PathLike):
        path = os.fspath(directory)
        if isinstance(path, str):
            return repr(os.path.abspath(path))
    return f"{directory!r:.200}"


def _kind(obj: object) -> str:
    return type(unwrap_model(obj) if isinstance(obj, nn.Module) else obj).__name__


def call_of(
    directory: object, objects: Mapping[str, Any], options: Mapping[str, object],
    problem: BaseException | None = None, machine: int | None = None,
) -> Call:
    """The signature of one call: directory, ``options`` (as given), object names and kinds.

    Never raises: a value that is not what the function takes is shown by its ``repr``.
    """
    shown = [("directory", _directory(directory))]
    shown += [(key, f"{value!r:.200}") for key, value in options.items()]
    names = ", ".join(f"{name}={_kind(obj)}" for name, obj in sorted(objects.items()))
    shown.append(("objects", f"[{names}]"))
    text = None if problem is None else describe(problem)
    return Call(signature=tuple(shown), problem=text, machine=machine)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _differences(key: str, values: Sequence[tuple[int, str]], where: str = "") -> str | None:
    """``key``'s values grouped by the ranks holding each, when they are not all the same."""
    by_value: dict[str, list[int]] = {}
    for rank, value in values:
        by_value.setdefault(value, []).append(rank)
    if len(by_value) < 2:
        return None
    shown = [f"{value} on {_ranks(ranks)}" for value, ranks in list(by_value.items())[:_SHOWN]]
    if len(by_value) > _SHOWN:
        shown.append(f"{len(by_value) - _SHOWN} more values")
    return f"{key}{where}: {', '.join(shown)}"


def _mismatch(calls: Sequence[Call]) -> str | None:
    per_machine = all(c.machine is not None for c in calls)
    keys = list(dict.fromkeys(k for c in calls for k, _ in c.signature))
    parts: list[str | None] = []
    for key in keys:
        values = [(r, dict(c.signature).get(key, "<absent>")) for r, c in enumerate(calls)]
        if key != "directory" or not per_machine:
            parts.append(_differences(key, values))
            continue
        for machine in sorted({c.machine for c in calls if c.machine is not None}):
            ours = [(r, v) for r, v in values if calls[r].machine == machine]
            parts.append(_differences(key, ours, f" (on the machine node_rank={machine})"))
    found = [p for p in parts if p is not None]
    return "; ".join(found) if found else None


def settle(op: str, calls: Sequence[Call], own: BaseException | None, effect: str) -> None:
    """Raise on every rank alike when the ranks' calls differ or any rank's arguments failed.

    ``calls`` is every rank's :class:`Call` in rank order (the same list on every rank); ``own``
    is this rank's argument error, raised as itself when every rank passed the same arguments
    (they all met it). ``effect`` says what did not happen ("nothing was written").

    Raises:
        CheckpointError: the ranks passed different arguments, naming each rank's values; or
            another rank's arguments failed.
    """
    mismatch = _mismatch(calls)
    if mismatch is not None:
        raise CheckpointError(
            f"accel.{op}() was called with different arguments on different ranks: "
            f"{mismatch}. Every rank must call accel.{op}() with the same {_AGREED[op]}; "
            f"{effect}. Compute the arguments the same way on every rank (a path relative to "
            "each rank's working directory, or a step counted per rank, differs)."
        )
    if own is not None:
        raise own
    failed = [(rank, c.problem) for rank, c in enumerate(calls) if c.problem is not None]
    if failed:
        raise CheckpointError(
            f"accel.{op}() failed on {_ranks([r for r, _ in failed])}: "
            + " | ".join(dict.fromkeys(f"rank {r}: {p}" for r, p in failed))
            + f"; {effect}."
        )


def agreed_target(directory: Path, target: Path | None, kind: str) -> Path | None:
    """The foreign checkpoint (``kind``: "Accelerate", "DeepSpeed") every rank found at
    ``directory``, or ``None`` when no rank found one. A collective: every rank calls it.

    Raises:
        CheckpointError: the ranks found different ones (or some none), naming each rank's.

    Example:
        >>> agreed_target(Path("ckpt"), Path("ckpt"), "Accelerate")
        PosixPath('ckpt')
    """
    seen = gather_object(None if target is None else os.fspath(target))
    if all(s is None for s in seen):
        return None
    if len(set(seen)) > 1:
        raise CheckpointError(
            f"The ranks see different checkpoints at {os.fspath(directory)!r} (by rank: "
            f"{seen}); every rank must reach the same {kind} checkpoint. Put it on a "
            "filesystem every rank shares."
        )
    assert target is not None  # every rank saw the same non-None path
    return target

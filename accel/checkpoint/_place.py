"""The place a ``save_state`` writes to, prepared and tidied under its writer lock.

Each writer (rank 0, or each machine's local main process with ``on_each_node``) takes the
lock of its place, repairs what killed saves left, refuses directories holding foreign
entries, makes the hidden temporary directory, and after the swap rotates old checkpoints.
"""

from __future__ import annotations

import os
import re
import warnings
from contextlib import ExitStack
from pathlib import Path

from accel._files.atomic import recover, remove_dir, temp_sibling, writer_lock
from accel.checkpoint.layout import (
    MANIFEST,
    foreign_entries,
    is_complete,
    lock_path,
    manifest_problem,
)
from accel.errors import CheckpointError

__all__ = ["lock", "prepare_target", "recover_root", "rotate"]

_STEP_DIR = re.compile(r"^checkpoint_([0-9]+)\Z")
_LEFTOVER = re.compile(r"^\.(checkpoint_[0-9]+)\.(?:tmp|old|trash)-[0-9a-f]+\Z")


def lock(root: Path, numbered: bool, where: str, each: bool) -> ExitStack:
    """The writer lock of the place, with a hint when machines share it by mistake."""
    stack = ExitStack()
    try:
        stack.enter_context(writer_lock(lock_path(root, numbered), repr(where)))
    except CheckpointError as exc:
        if not each:
            raise
        raise CheckpointError(
            f"{exc} With on_each_node=True each machine's local main process writes its own "
            "copy: if the machines share this filesystem, save with on_each_node=False."
        ) from None
    return stack


def recover_root(root: Path) -> None:
    """Repair or remove what killed saves left in a root of numbered checkpoints."""
    if not root.is_dir():
        return
    names = {m.group(1) for n in os.listdir(root) if (m := _LEFTOVER.match(n))}
    for name in sorted(names):
        recover(root / name, is_complete)


def prepare_target(directory: str | os.PathLike[str], final: Path, numbered: bool) -> Path:
    """Under the writer lock: repair leftovers, refuse foreign directories, make the tmp dir."""
    root = final.parent if numbered else final
    if numbered:
        if os.path.lexists(root) and not root.is_dir():
            raise CheckpointError(
                f"save_state({os.fspath(directory)!r}, step=...) needs a directory to hold "
                "`checkpoint_N` directories, but that path is a file. Choose another path."
            )
        recover_root(root)
    else:
        recover(final, is_complete)
    foreign = foreign_entries(final)
    if foreign:
        shown = ", ".join(repr(name) for name in foreign[:10])
        more = f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        raise CheckpointError(
            f"save_state({os.fspath(directory)!r}) would replace {os.fspath(final)!r}, which "
            f"holds entries accel did not write: {shown}{more}. accel only replaces its own "
            "checkpoints. Save numbered checkpoints inside it with "
            f"`accel.save_state({os.fspath(directory)!r}, step=N, ...)`, or pass a new or "
            "empty directory."
        )
    tmp = temp_sibling(final)
    tmp.mkdir(parents=True)
    return tmp


def rotate(root: Path, total_limit: int, keep: Path) -> None:
    """Remove the oldest complete ``checkpoint_N`` beyond ``total_limit`` (never ``keep``).

    One whose manifest is refused (corrupted or crafted) is neither counted nor deleted: it
    is kept, with a warning.
    """
    complete = []
    refused: list[str] = []
    for name in os.listdir(root):
        if not (m := _STEP_DIR.match(name)):
            continue
        problem = manifest_problem(root / name)  # one read each (no manifest: incomplete)
        if problem is not None:
            refused.append(f"{os.fspath(root / name)!r}: {problem}")
        elif os.path.lexists(root / name / MANIFEST):
            complete.append((int(m.group(1)), root / name))
    if refused:
        more = f" (and {len(refused) - 10} more)" if len(refused) > 10 else ""
        warnings.warn(
            f"save_state(total_limit={total_limit}) keeps and does not count "
            f"{'; '.join(sorted(refused)[:10])}{more}. Delete them yourself once you no longer "
            "need them.",
            stacklevel=3,
        )
    complete.sort()
    for _, path in complete[: max(0, len(complete) - total_limit)]:
        if path == keep:
            continue
        foreign = foreign_entries(path)
        if foreign:
            warnings.warn(
                f"save_state(total_limit={total_limit}) keeps {os.fspath(path)!r}: it holds "
                f"entries accel did not write ({foreign[:5]}). Move them, then delete it.",
                stacklevel=3,
            )
            continue
        remove_dir(path)

"""Crash-safe placement of files and directories: write aside, fsync, rename into place."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from accel.checkpoint._format import fsync_dir

__all__ = ["replace_dir", "remove_dir", "write_file_atomically"]

T = TypeVar("T")


def write_file_atomically(path: Path, write: Callable[[Path], T]) -> T:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it into place.

    A crash at any point leaves either the old file or the new one, never a partial file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        result = write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return result


def remove_dir(path: Path) -> None:
    """Delete a directory so that no half-deleted copy is ever seen under its name."""
    if not path.exists():
        return
    trash = path.with_name(f".{path.name}.trash-{uuid.uuid4().hex[:12]}")
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the complete directory ``tmp`` to ``final``, replacing an older ``final``."""
    fsync_dir(tmp)
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:12]}")
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_dir(final.parent)

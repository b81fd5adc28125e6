"""Crash-safe placement of files and directories: write aside, fsync, swap into place.

The rules every writer in :mod:`accel.checkpoint` follows:

* A new file or directory is built under a hidden temporary sibling
  (``.NAME.tmp-<hex>``) and moved into place by a rename when complete.
* An existing directory is replaced with no instant at which neither the old nor the new one
  exists under its name: ``renameat2(RENAME_EXCHANGE)`` swaps them in one step where the
  platform has it (Linux >= 3.15); elsewhere the old one is renamed aside to ``.NAME.old-<hex>``
  first, and :func:`recover` puts it back if the process died before the new one arrived.
* Leftovers of killed writers (``.NAME.tmp-*``, ``.NAME.old-*``, ``.NAME.trash-*``) are removed
  only by a writer holding the :func:`writer_lock` of that place, so two writers never delete
  each other's work.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import socket
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from accel._files.format import fsync_dir
from accel._files.safe_io import open_lock
from accel.errors import CheckpointError

__all__ = [
    "exchange",
    "leftovers",
    "recover",
    "remove_dir",
    "replace_dir",
    "temp_sibling",
    "write_file_atomically",
    "writer_lock",
]

T = TypeVar("T")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_KINDS = ("tmp", "old", "trash")


def temp_sibling(path: Path, kind: str = "tmp") -> Path:
    """A fresh hidden sibling name of ``path`` for a writer's scratch copy."""
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:12]}")


def write_file_atomically(path: Path, write: Callable[[Path], T]) -> T:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it into place.

    A crash at any point leaves either the old file or the new one, never a partial file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    try:
        result = write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return result


def _renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function: Callable[..., int] = libc.renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl without the wrapper
        return None
    return function


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; ``False`` where the platform cannot."""
    function = _renameat2()
    if function is None:
        return False
    result = function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (38, 22, 95):  # ENOSYS, EINVAL (flag or filesystem), EOPNOTSUPP
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def remove_dir(path: Path, *, owner: Path | None = None) -> None:
    """Delete a directory so that no half-deleted copy is ever seen under its name.

    It is first renamed to a ``trash`` sibling of ``owner`` (default: itself), the name that
    :func:`recover` of ``owner`` removes if the deletion is cut short.
    """
    if not os.path.lexists(path):
        return
    trash = temp_sibling(owner or path, "trash")
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the complete directory ``tmp`` to ``final``, replacing an older ``final``.

    At every instant ``final`` names either the old directory or the new one, where the
    platform can swap atomically; elsewhere the old one waits at ``.NAME.old-*`` (found by
    :func:`recover` and by loaders) until the new one is in place.
    """
    fsync_dir(tmp)
    if not os.path.lexists(final):
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return
    if exchange(tmp, final):
        fsync_dir(final.parent)
        remove_dir(tmp, owner=final)  # it now holds the old directory
        return
    old = temp_sibling(final, "old")
    os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    remove_dir(old, owner=final)


def leftovers(final: Path, kind: str) -> list[Path]:
    """Hidden scratch siblings of ``final`` of one kind (``tmp``, ``old`` or ``trash``).

    Only entries of this user count: a writer's scratch copies are its own, and one planted
    by another user in a shared parent directory (``/scratch``) is never read as an old
    checkpoint, moved into place or emptied into the user's directory.
    """
    if kind not in _KINDS:
        raise CheckpointError(f"leftovers(kind={kind!r}): kind must be one of {list(_KINDS)}.")
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.{kind}-[0-9a-f]+\Z")
    try:
        names = os.listdir(final.parent)
    except OSError:
        return []
    return sorted(final.parent / n for n in names if pattern.match(n) and _own(final.parent / n))


def _own(path: Path) -> bool:
    """Whether ``path`` (not followed) belongs to this process's user (always, without uids)."""
    user = getattr(os, "geteuid", None)
    try:
        return user is None or os.lstat(path).st_uid == user()
    except OSError:
        return False


def _only_files(path: Path) -> bool:
    """Whether ``path`` is a directory of plain files, as every checkpoint writer makes."""
    try:
        return all(e.is_file(follow_symlinks=False) for e in os.scandir(path))
    except OSError:
        return False


def recover(final: Path, is_complete: Callable[[Path], bool]) -> None:
    """Repair what a killed writer left around ``final``; call only under its writer lock.

    If ``final`` is missing but a complete old copy waits aside (a writer died between
    the two renames of the fallback replace), that copy is put back. Then the scratch
    siblings are removed (none belongs to a live writer while the lock is held), except one
    holding anything but plain files: no checkpoint writer makes those, so it is left alone
    with a warning rather than deleted.
    """
    if not os.path.lexists(final):
        for old in reversed(leftovers(final, "old")):
            if is_complete(old):
                os.replace(old, final)
                fsync_dir(final.parent)
                break
    for kind in _KINDS:
        for path in leftovers(final, kind):
            if path.is_symlink() or not path.is_dir():
                path.unlink(missing_ok=True)
            elif _only_files(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                warnings.warn(
                    f"{os.fspath(path)!r} looks like a leftover of a killed save but holds "
                    "directories or links that accel's checkpoints never contain; it is kept. "
                    "Move what you need out of it, then delete it.",
                    stacklevel=3,
                )


_LOCK_TRIES = 100  # a lock file replaced this often while we take it: another writer's


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` (not followed) still names the open file ``fd``."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _take(path: Path, what: str, fcntl: ModuleType) -> int:
    """Open and lock the lock file now at ``path``; its descriptor (the lock is held)."""
    for _ in range(_LOCK_TRIES):
        fd = open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(
                f"Another writer is saving to {what} right now (lock {os.fspath(path)!r} held "
                f"by {holder}). Two jobs must not write to one checkpoint location: give each "
                "its own directory, or wait until the other save finishes."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it after we opened it: take the one there now
    raise CheckpointError(
        f"The lock file {os.fspath(path)!r} of {what} was replaced {_LOCK_TRIES} times while "
        "accel took it: other writers keep saving there. Two jobs must not write to one "
        "checkpoint location: give each its own directory."
    )


@contextmanager
def writer_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if needed) for one writer.

    The lock file is opened by :func:`~accel._files.safe_io.open_lock`: created
    exclusively, or an existing file that accel made (a regular file of this user, one link,
    at most one ``pid N on HOST`` line), never through a symbolic link; so writing the
    holder's pid into it cannot overwrite a file planted under that name.

    The holder removes the file when it is done (the body returned or raised) while it still
    holds the lock, so no lock file outlives its writer. That is safe because a writer that
    takes the lock checks that the path still names the file it locked, and otherwise takes
    the file there now: a file its holder removed locks nothing. A killed writer leaves its
    lock file (no lock is held on it): the next writer of the place reuses it and removes it.

    Raises:
        CheckpointError: another process holds it (two jobs writing to one place), or the
            path holds a link, a special file or a file accel did not write.

    Example:
        >>> with writer_lock(Path(".ckpt.accel-lock"), "the checkpoint 'ckpt'"):
        ...     ...  # write; the lock file is gone afterwards
    """
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks through this route
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _take(path, what, fcntl)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        try:
            if _same_file(fd, path):  # it is ours while we hold it: remove, then release
                os.unlink(path)
        except OSError:  # a read-only or vanished parent: the next writer reuses it
            pass
        finally:
            os.close(fd)  # closing releases the lock

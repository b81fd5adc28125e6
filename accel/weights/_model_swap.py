"""Replace the weight set in a ``save_model`` directory as a whole, keeping the user's entries.

One save over an existing directory ``out`` runs under the writer lock ``.out.accel-lock``
beside it:

1. the new weights are written into a hidden sibling ``.out.tmp-<hex>`` and fsynced;
2. the user's regular files in ``out`` are hard-linked into it (copied where linking fails)
   and symlinks re-created; weight files of earlier saves are not carried;
3. ``out`` and the new directory swap names in one step (``renameat2(RENAME_EXCHANGE)``).
   Where the platform cannot, ``out`` is renamed to ``.out.old-<hex>`` and the new directory
   renamed in: a process killed between the two renames leaves ``out`` missing for a moment,
   and the next load or save puts the old one back;
4. the user's subdirectories (and anything else not carried) move from the old directory into
   ``out``, one atomic rename each;
5. from the old directory, only what accel wrote is deleted (weight files, and entries ``out``
   holds the same copy of); it is removed when empty, else left in place with a warning.

So at every instant ``out`` holds one complete weight set, the old or the new, and every user
file; each user subdirectory is in ``out`` or in the old directory, and the next save moves it
back (:func:`recover`).
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import stat
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from accel._files.atomic import (
    exchange,
    leftovers,
    temp_sibling,
    writer_lock,
)
from accel._files.format import fsync_dir
from accel.errors import CheckpointError

__all__ = [
    "WEIGHT_FILE",
    "carry",
    "check_target",
    "discard",
    "install",
    "locked",
    "old_copy",
    "recover",
    "restore",
]

#: Names of weight files that ``save_model`` writes (or transformers did): never carried over.
WEIGHT_FILE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin"
    r"|model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json)$"
)
_COPY = re.compile(r"^\.accel-copy-[0-9a-f]{12}$")  # a copy being made, renamed when complete
_KINDS = ("tmp", "old", "trash")


def _is_weight_file(path: Path) -> bool:
    return WEIGHT_FILE.match(path.name) is not None and (path.is_symlink() or not path.is_dir())


def _written_by_accel(path: Path) -> bool:
    return _is_weight_file(path) or _COPY.match(path.name) is not None


def check_target(out: Path, names: Iterable[str]) -> None:
    """Refuse a target that cannot take a new weight set, before anything is written.

    Raises:
        CheckpointError: ``out`` is not a directory, is a mount point (it cannot be swapped
            with a sibling), or holds a directory named like a weight file to be written.
    """
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise CheckpointError(
            f"save_model target {os.fspath(out)!r} exists and is not a directory. Give a "
            "directory (new or existing) to write model.safetensors and its shards into."
        )
    if os.stat(out).st_dev != os.stat(out.parent).st_dev:
        raise CheckpointError(
            f"save_model target {os.fspath(out)!r} is a mount point: the new weights are "
            "built beside it and swapped in, which cannot cross filesystems. Save into a "
            f"subdirectory instead, e.g. {os.fspath(out / 'model')!r}."
        )
    for name in names:
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise CheckpointError(
                f"{os.fspath(out / name)!r} is a directory, but save_model writes a weight "
                "file of that name. Move or rename it, or save to another directory."
            )


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold the writer lock of the ``save_model`` directory ``out``.

    Raises:
        CheckpointError: another process is saving there, or the lock cannot be created.
    """
    lock = out.parent / f".{out.name}.accel-lock"
    with ExitStack() as stack:
        try:
            stack.enter_context(writer_lock(lock, f"the save_model directory {os.fspath(out)!r}"))
        except PermissionError as exc:
            raise CheckpointError(
                f"save_model builds the new weights beside {os.fspath(out)!r} and swaps them "
                f"in, so it needs to write in {os.fspath(out.parent)!r}, which is not writable "
                f"({exc}). Save to a directory whose parent is writable."
            ) from None
        yield


def old_copy(out: Path, is_complete: Callable[[Path], bool]) -> Path | None:
    """The complete ``.out.old-*`` copy that stands for a missing ``out``, if there is one."""
    if os.path.lexists(out):
        return None
    olds = [p for p in leftovers(out, "old") if p.is_dir() and not p.is_symlink()]
    complete = [p for p in olds if is_complete(p)]
    return max(complete, key=lambda p: p.stat().st_mtime_ns) if complete else None


def restore(out: Path, is_complete: Callable[[Path], bool]) -> bool:
    """Put the old directory back where a killed fallback swap left ``out`` missing.

    Call only under :func:`locked`. A complete old copy is preferred; an old directory
    without weights (the first save into a user's directory) is put back too.
    """
    if os.path.lexists(out):
        return False
    olds = [p for p in leftovers(out, "old") if p.is_dir() and not p.is_symlink()]
    if not olds:
        return False
    best = max(olds, key=lambda p: (is_complete(p), p.stat().st_mtime_ns))
    os.replace(best, out)
    fsync_dir(out.parent)
    return True


def _same_entry(a: Path, b: Path) -> bool:
    """Whether ``b`` holds what ``a`` holds: the same file (inode or bytes) or symlink."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(sa.st_mode) and stat.S_ISLNK(sb.st_mode):
        return os.readlink(a) == os.readlink(b)
    if stat.S_ISREG(sa.st_mode) and stat.S_ISREG(sb.st_mode):
        if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
            return True
        return sa.st_size == sb.st_size and filecmp.cmp(a, b, shallow=False)
    return False


def _drain(old: Path, out: Path) -> None:
    """Empty a replaced or abandoned directory: the user's entries go to ``out``.

    Entries ``out`` lacks move there (one rename each); weight files and entries ``out``
    holds the same copy of are deleted. ``old`` is removed if nothing else is left; anything
    else stays, with a warning naming it: accel never deletes what it did not write.
    """
    names = sorted(os.listdir(old))
    moved = False
    if out.is_dir():
        for name in names:
            if not _written_by_accel(old / name) and not os.path.lexists(out / name):
                os.rename(old / name, out / name)
                moved = True
    if moved:
        fsync_dir(out)
    kept = []
    for name in sorted(os.listdir(old)):
        if _written_by_accel(old / name) or _same_entry(old / name, out / name):
            os.unlink(old / name)
        else:
            kept.append(name)
    if kept:
        fsync_dir(old)
        warnings.warn(
            f"save_model left {os.fspath(old)!r} in place: it holds {kept[:5]}, which accel "
            f"did not write and {os.fspath(out)!r} holds a different entry of that name. "
            "Compare them and delete that directory yourself.",
            stacklevel=4,
        )
        return
    os.rmdir(old)
    fsync_dir(out.parent)


def recover(out: Path, is_complete: Callable[[Path], bool]) -> None:
    """Finish whatever a killed ``save_model`` left around ``out``; call under :func:`locked`.

    A missing ``out`` is put back from its old copy; then every scratch sibling is drained
    into ``out`` (user subdirectories move back, accel's files are deleted) and removed.
    """
    restore(out, is_complete)
    for kind in _KINDS:
        for path in leftovers(out, kind):
            if path.is_dir() and not path.is_symlink():
                _drain(path, out)
            else:  # a scratch file of accel's own naming
                path.unlink(missing_ok=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
        return
    except OSError:  # a filesystem without hard links, or a file owned by someone else
        pass
    part = dst.with_name(f".accel-copy-{uuid.uuid4().hex[:12]}")
    shutil.copy2(src, part)
    fd = os.open(part, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, dst)


def carry(out: Path, new: Path) -> None:
    """Give the directory ``new`` the user's files of ``out``: hard links, symlinks as symlinks.

    Weight files of earlier saves are left behind (they are stale once ``new`` is in place);
    subdirectories and special files move after the swap, in :func:`install`.
    """
    for entry in sorted(os.scandir(out), key=lambda e: e.name):
        src, dst = out / entry.name, new / entry.name
        if _is_weight_file(src) or os.path.lexists(dst):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif entry.is_file(follow_symlinks=False):
            _link_or_copy(src, dst)
    os.chmod(new, stat.S_IMODE(os.stat(out).st_mode))


def discard(new: Path, out: Path) -> None:
    """Delete a new directory that was never put in place (it holds only what accel wrote).

    It is renamed to a ``trash`` sibling of ``out`` first, which :func:`recover` finishes if
    the deletion is cut short.
    """
    trash = temp_sibling(out, "trash")
    os.replace(new, trash)
    shutil.rmtree(trash, ignore_errors=True)


def install(new: Path, out: Path) -> None:
    """Put the complete directory ``new`` at ``out``; call under :func:`locked`.

    ``new`` already holds the new weights and (see :func:`carry`) the user's files.
    """
    fsync_dir(new)
    if not os.path.lexists(out):
        os.replace(new, out)
        fsync_dir(out.parent)
        return
    cwd_was_out = _is_cwd(out)
    try:
        swapped = exchange(new, out)
    except OSError:
        discard(new, out)
        raise
    if swapped:
        old = new  # the old directory now has the scratch name
    else:  # no atomic swap here: rename the old one aside first (see restore())
        old = temp_sibling(out, "old")
        os.replace(out, old)
        os.replace(new, out)
    fsync_dir(out.parent)
    if cwd_was_out:
        os.chdir(out)  # the process's working directory was the replaced directory
    _drain(old, out)


def _is_cwd(path: Path) -> bool:
    try:
        return os.path.samefile(os.getcwd(), path)
    except OSError:
        return False

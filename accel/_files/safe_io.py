"""Checkpoint files as untrusted input: safe opening, bounded reads, one strict JSON loader.

A checkpoint may come from anywhere (a shared scratch directory, an archive, a download), so
every file accel opens in one is handled as hostile:

* **Opening.** Files are opened with ``O_NOFOLLOW`` (inside a ``save_state`` checkpoint: a
  symbolic link is refused, wherever it points) and ``O_NONBLOCK`` (a FIFO cannot block the
  open), then ``fstat``-ed: anything but a regular file (FIFO, device, socket, directory) is
  refused before a byte is read. Weight folders in the transformers layout may hold links
  (the Hugging Face cache links every file to a blob), so their readers follow links, and
  still take only regular files.
* **Reading.** A file is read only up to what its manifest declares (plus one byte, to see a
  file that grew), or up to a fixed bound for files without a declared size: never until the
  data stops, so ``/dev/zero`` or a growing file cannot exhaust memory.
* **JSON.** :func:`load_json` refuses, as a :class:`~accel.errors.CheckpointError`, a text over
  :data:`MAX_JSON_BYTES`, nested deeper than :data:`MAX_JSON_DEPTH` (measured without recursion
  before parsing, so no ``RecursionError``), with a key twice in one object, or holding
  ``NaN`` / ``Infinity`` (accel writes non-finite floats in a tagged form, never as these).
* **Locks.** :func:`open_lock` never truncates or writes into a file it did not create: a new
  lock file is created exclusively; an existing one is used only when it is a regular file of
  this user, with one link, holding nothing but what accel writes there.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from accel.core.strict_json import parse_json
from accel.errors import CheckpointError

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "load_json",
    "open_lock",
    "open_regular",
    "open_write",
    "pread_into",
    "read_bounded",
    "read_declared",
    "refuse_link",
]

#: The largest JSON text accel reads from a checkpoint (manifest, index, structure file,
#: safetensors header); ``save_state`` refuses to write a larger one.
MAX_JSON_BYTES = 64 << 20
#: The deepest nesting of JSON arrays and objects accel reads (its own files nest < 10 deep).
MAX_JSON_DEPTH = 128
#: The largest lock file accel takes as its own (it writes one line: ``pid N on HOST``).
MAX_LOCK_BYTES = 4096

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation
_CHUNK = 8 << 20  # bytes per read() and per slice of the nesting scan
_LOCK_TEXT = re.compile(rb"(pid [0-9]+ on [^\n]*\n)?")
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _link_refused(path: str) -> CheckpointError:
    try:
        target = f" (to {os.readlink(path)!r:.200})"
    except OSError:
        target = ""
    return CheckpointError(
        f"{path!r} is a symbolic link{target}: accel follows no link inside a checkpoint, so "
        "a crafted checkpoint cannot make it read or overwrite a file elsewhere. Put the file "
        "itself there (e.g. `cp --remove-destination TARGET LINK`), or load another checkpoint."
    )


def refuse_link(path: str | os.PathLike[str]) -> None:
    """Refuse ``path`` if it is a symbolic link (a file's or a directory's), wherever it points.

    For the entries of a checkpoint that are not opened as files (a tag's directory) or that
    are listed before they are opened; :func:`open_regular` refuses a linked file by itself.

    Raises:
        CheckpointError: ``path`` is a symbolic link; the message names it and its target.

    Example:
        >>> refuse_link(Path("ds_ckpt") / "global_step3")
    """
    where = os.fspath(path)
    if os.path.islink(where):
        raise _link_refused(where)


def _not_regular(path: str, mode: int) -> CheckpointError:
    return CheckpointError(
        f"{path!r} is {_kind(mode)}, not a regular file: accel reads and writes only regular "
        "files in checkpoints, so a crafted entry cannot block a load or feed it endless "
        "data. Replace it with the file that belongs there, or load another checkpoint."
    )


def _open(path: str, flags: int, follow_links: bool, mode: int = 0o644) -> int:
    """``os.open`` that reports a refused link or a special file as a CheckpointError."""
    try:
        return os.open(path, flags | (0 if follow_links else _NOFOLLOW), mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and not follow_links:
            if os.path.islink(path):
                raise _link_refused(path) from None
        elif not isinstance(exc, FileNotFoundError | PermissionError | FileExistsError):
            try:
                found = os.stat(path) if follow_links else os.lstat(path)
            except OSError:
                raise exc from None
            if not stat.S_ISREG(found.st_mode):
                raise _not_regular(path, found.st_mode) from None
        raise


def _regular(fd: int, path: str) -> os.stat_result:
    """The ``fstat`` of an open file; closes it and raises unless it is a regular file."""
    try:
        found = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(found.st_mode):
        os.close(fd)
        raise _not_regular(path, found.st_mode)
    return found


def open_regular(path: str | os.PathLike[str], *, follow_links: bool = False) -> int:
    """A read-only descriptor of the regular file ``path``; the caller closes it.

    Raises:
        CheckpointError: ``path`` is a symbolic link (unless ``follow_links``) or not a
            regular file (FIFO, device, socket, directory). Nothing was read from it.
        OSError: it cannot be opened (``FileNotFoundError`` when it does not exist).
    """
    where = os.fspath(path)
    fd = _open(where, os.O_RDONLY | _NONBLOCK | _CLOEXEC | _BINARY, follow_links)
    _regular(fd, where)
    return fd


def open_write(path: str | os.PathLike[str]) -> int:
    """A write-only descriptor of ``path``, created or truncated; never through a link.

    Opened without blocking (a FIFO there fails or is refused instead of waiting for a
    reader), then checked to be a regular file.

    Raises:
        CheckpointError: ``path`` is a symbolic link or a special file.
        OSError: it cannot be created.
    """
    where = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NONBLOCK | _CLOEXEC | _BINARY
    fd = _open(where, flags, follow_links=False)
    _regular(fd, where)
    return fd


def _read_upto(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes from ``fd``'s position, stopping early at its end."""
    parts: list[bytes] = []
    left = limit
    while left > 0:
        part = os.read(fd, min(left, _CHUNK))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_declared(path: str | os.PathLike[str], size: int) -> bytes:
    """The whole regular file ``path`` (no link followed), which must hold ``size`` bytes.

    At most ``size + 1`` bytes are read, so a file that is longer than declared (or grows,
    or never ends) is refused without reading it all.

    Raises:
        CheckpointError: a link, a special file, or another size than ``size``.
        OSError: it cannot be opened (``FileNotFoundError`` when it does not exist).
    """
    where = os.fspath(path)
    fd = open_regular(where)
    try:
        actual = os.fstat(fd).st_size
        data = _read_upto(fd, size + 1) if actual == size else b""
    finally:
        os.close(fd)
    if actual != size:
        raise CheckpointError(
            f"Checkpoint file {where!r} has {actual} bytes, the manifest says {size}: it is "
            "truncated or corrupted. Load an earlier checkpoint."
        )
    if len(data) != size:
        raise CheckpointError(
            f"Checkpoint file {where!r} changed size while it was read (the manifest says "
            f"{size} bytes): another program is writing it. Load it again once it is done."
        )
    return data


def read_bounded(
    path: str | os.PathLike[str], limit: int = MAX_JSON_BYTES, *, follow_links: bool = False
) -> bytes:
    """The whole regular file ``path``, refused if it is over ``limit`` bytes.

    Raises:
        CheckpointError: a link (unless ``follow_links``), a special file, or over ``limit``.
        OSError: it cannot be opened (``FileNotFoundError`` when it does not exist).
    """
    where = os.fspath(path)
    fd = open_regular(where, follow_links=follow_links)
    try:
        declared = os.fstat(fd).st_size
        data = _read_upto(fd, limit + 1) if declared <= limit else b""
    finally:
        os.close(fd)
    if declared > limit or len(data) > limit:
        raise CheckpointError(
            f"{where!r} holds more than {limit} bytes ({max(declared, len(data))}), more than "
            "accel reads for such a file: it is corrupted or crafted. Write it again, or load "
            "another checkpoint."
        )
    return data


def pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Read from ``fd`` at ``offset`` into ``buffer`` (at most what one call returns).

    ``os.preadv`` fills ``buffer`` in place where the platform has it; elsewhere one
    ``os.pread`` is copied into it. The file position of ``fd`` does not move.

    Args:
        fd: An open, readable file descriptor.
        buffer: A writable memoryview the bytes go into, from its start.
        offset: Where in the file to read from.

    Returns:
        The number of bytes read: fewer than ``len(buffer)`` near the end, 0 at the end.

    Example:
        >>> buffer = memoryview(bytearray(8))
        >>> got = pread_into(fd, buffer, 0)
    """
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buffer], offset)
    data = os.pread(fd, len(buffer), offset)
    buffer[: len(data)] = data
    return len(data)


def _default_error(problem: str) -> CheckpointError:
    return CheckpointError(
        f"A checkpoint file is invalid: {problem}. It is corrupted or was not written by "
        "accel; load an earlier checkpoint."
    )


def load_json(
    data: bytes, error: Callable[[str], CheckpointError] = _default_error
) -> Any:
    """Parse untrusted JSON; every refusal is ``error(what was wrong)``.

    Refused: more than :data:`MAX_JSON_BYTES`, nesting deeper than :data:`MAX_JSON_DEPTH`,
    text that is not UTF-8 JSON, a key twice in one object, ``NaN`` / ``Infinity`` or a
    number too large for a float.

    Example:
        >>> load_json(b'{"a": 1}')
        {'a': 1}
    """
    if len(data) > MAX_JSON_BYTES:
        raise error(f"it is {len(data)} bytes, more than the {MAX_JSON_BYTES} accel reads")
    return parse_json(
        data, error, max_depth=MAX_JSON_DEPTH, depth_note=", far beyond anything accel writes",
        constant_note=" and which accel never writes",
    )


def open_lock(path: str | os.PathLike[str]) -> int:
    """A read-write descriptor of the lock file ``path``, created if needed.

    The descriptor is safe to truncate and write (the holder's pid): a new file is created
    exclusively (``O_CREAT | O_EXCL``), never through a link; an existing one is opened without
    ``O_TRUNC`` and without following a link, and used only when it is a regular file owned
    by this user, with a single link, holding at most one ``pid N on HOST`` line. Anything
    else is refused, untouched.

    Raises:
        CheckpointError: the path holds a link, a special file or a file accel did not write.
        OSError: it cannot be created (``PermissionError`` in a read-only directory).
    """
    where = os.fspath(path)
    flags = os.O_RDWR | _NONBLOCK | _CLOEXEC | _BINARY
    for _ in range(3):  # a lock file removed between the two opens is created again
        try:
            return _open(where, flags | os.O_CREAT | os.O_EXCL, follow_links=False)
        except FileExistsError:
            pass
        try:
            fd = _open(where, flags, follow_links=False)
        except FileNotFoundError:
            continue
        found = _regular(fd, where)
        problem = _foreign_lock(fd, found)
        if problem is None:
            return fd
        os.close(fd)
        raise CheckpointError(
            f"The lock file {where!r} exists but {problem}, so accel did not make it; accel "
            "writes its lock holder there and will not touch a file it did not write. If no "
            "accel save is running there, move that file away (or delete it) and save again."
        )
    raise CheckpointError(
        f"The lock file {where!r} keeps disappearing while accel opens it: another program "
        "removes it. Stop that program, or save to another directory."
    )


def _foreign_lock(fd: int, found: os.stat_result) -> str | None:
    """Why an existing regular file is not one of accel's lock files, or ``None``."""
    owner = getattr(os, "geteuid", None)
    if owner is not None and found.st_uid != owner():
        return f"belongs to user id {found.st_uid}, not to this process's {owner()}"
    if found.st_nlink != 1:
        return f"has {found.st_nlink} hard links (a lock file has one)"
    if found.st_size > MAX_LOCK_BYTES:
        return f"holds {found.st_size} bytes (a lock file holds one short line)"
    text = os.pread(fd, MAX_LOCK_BYTES + 1, 0)
    if _LOCK_TEXT.fullmatch(text) is None:
        return f"holds {text[:60]!r}, not a 'pid N on HOST' line"
    return None

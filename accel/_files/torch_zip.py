"""Checking a torch (zip) file before torch reads or maps it.

``torch.save`` writes a zip archive whose members are all *stored* (never compressed):
``ARCHIVE/data.pkl`` (the pickled object, whose tensors name their storages by key) and one
member ``ARCHIVE/data/KEY`` per storage holding its raw bytes. ``torch.load(mmap=True)``
maps the whole file and takes each storage from the member's offset, trusting the pickle's
size and ignoring the member's compression and size; a plain ``torch.load`` inflates
compressed members into memory sized by what the pickle declares. So a hostile file either
loads wrong bytes (a compressed or shortened member) or allocates what it likes (a "zip
bomb").

:func:`check_torch_zip` refuses such a file before anything is decompressed, allocated or
mapped. It reads only the zip's central directory, each member's local header and
``data.pkl`` (small: it holds no tensor data), and checks:

* every member is stored uncompressed, unencrypted, its local header agrees with the
  central directory, and its bytes lie inside the file without overlapping another member;
* every storage the pickle declares has its member, holding exactly the declared number of
  bytes (the storage type's element size times its element count).

The pickle is read by an unpickler that builds nothing (:mod:`accel._files.torch_pickle`):
every global it names becomes an inert stand-in, storages are only recorded, and calls that
would build far more than the file holds (``bytearray(2**34)``, nested ``_codecs.encode``) are
refused, so no code of the file runs here and torch's own reading stays bounded. Its tensors
are charged their full logical size (element count times element size, whatever their strides:
a stride-0 view of one stored value counts every value it shows) against the budget of the
whole file (8 times its size plus 1 MiB), so a few KB of ``expand``-ed views cannot make a load,
a copy or a merge allocate gigabytes.
:func:`opened_torch_file` opens a file once (regular files only, without blocking on a
FIFO; with ``follow_links=False`` never through a symbolic link), checks it (a zip as above; a
file in torch's format before zip, or a bare pickle, by its pickles), and hands torch a path
to that same open file, so what was checked is what torch reads.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from accel._files.safe_io import open_regular
from accel._files.torch_pickle import budget_for, check_legacy, inspect
from accel.errors import CheckpointError

__all__ = ["MAX_MEMBERS", "check_torch_zip", "is_zip", "opened_torch_file"]

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header, before name and extra
_LOCAL_MAGIC = b"PK\x03\x04"
_ENCRYPTED = 0x1
_DESCRIPTOR = 0x8  # sizes and CRC follow the data; the local header may hold zeros
_UTF8 = 0x800
_NAME_GUESS = 226  # bytes read after a local header at once: its name, mostly
_END = struct.Struct("<4sHHHHIIH")  # the end of central directory record, before its comment
_END_MAGIC = b"PK\x05\x06"
_TAIL = (1 << 16) + _END.size  # where zipfile looks for that record: a comment is < 64 KiB
#: The most members a torch zip may have (a tensor storage each, and a few records): reading
#: a directory costs about 50 microseconds a member, so 10**6 of them would take a minute.
MAX_MEMBERS = 1 << 18


def _refuse(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where!r} is not a torch file accel reads: {what}. torch.save writes every member "
        "stored (uncompressed) with exactly the bytes its data.pkl declares, and a pickle that "
        "builds no more than the file holds, so the file was made or altered by something "
        "else and would load wrong values or unbounded memory. Write it again from its "
        "source with torch.save or accel.save."
    )


def _read_at(file: IO[bytes], offset: int, size: int) -> bytes:
    """Up to ``size`` bytes at ``offset`` (one ``pread`` for a real file)."""
    try:
        fd = file.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = -1
    if fd >= 0:
        parts, left = [], size
        while left > 0:
            part = os.pread(fd, left, offset + size - left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return b"".join(parts)
    file.seek(offset)
    data = file.read(size)
    return data if data is not None else b""


def _data_range(file: IO[bytes], info: zipfile.ZipInfo, where: str) -> tuple[int, int]:
    """Where ``info``'s bytes lie, after checking its local header against the directory."""
    name = info.filename
    if info.flag_bits & _ENCRYPTED:
        raise _refuse(where, f"member {name!r} is encrypted")
    if info.compress_type != zipfile.ZIP_STORED:
        raise _refuse(where, f"member {name!r} is compressed (zip method {info.compress_type})")
    if info.compress_size != info.file_size:
        raise _refuse(
            where, f"member {name!r} is stored in {info.compress_size} bytes but declares "
            f"{info.file_size}"
        )
    header = _read_at(file, info.header_offset, _LOCAL.size + _NAME_GUESS)
    if len(header) < _LOCAL.size:
        raise _refuse(where, f"the local header of member {name!r} lies past the end")
    fields = _LOCAL.unpack(header[: _LOCAL.size])
    magic, _, flags, method, _, _, _, packed, size, name_len, extra_len = fields
    raw_name = header[_LOCAL.size : _LOCAL.size + name_len]
    if len(raw_name) < name_len:  # a name longer than guessed
        raw_name = _read_at(file, info.header_offset + _LOCAL.size, name_len)
    local_name = raw_name.decode("utf-8" if flags & _UTF8 else "cp437", errors="replace")
    sizes_agree = (flags & _DESCRIPTOR and packed == size == 0) or (
        packed in (info.compress_size, 0xFFFFFFFF) and size in (info.file_size, 0xFFFFFFFF)
    )
    if magic != _LOCAL_MAGIC or method != zipfile.ZIP_STORED or local_name != info.orig_filename:
        raise _refuse(where, f"the local header of member {name!r} disagrees with the directory")
    if not sizes_agree or flags & _ENCRYPTED:
        raise _refuse(where, f"the local header of member {name!r} disagrees with the directory")
    start = info.header_offset + _LOCAL.size + name_len + extra_len
    return start, start + info.compress_size


def _refuse_pickle(where: str, part: str, what: str) -> CheckpointError:
    return _refuse(where, f"{part} {what}")


def _oversized(where: str, part: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where!r} is not a torch file accel reads: {part} {what}. accel charges each "
        "tensor of a torch file its full logical size, up to 8 times the bytes the file "
        "holds plus 1 MiB, as it bounds every call of its pickle: views that repeat stored "
        "values (`expand`, stride 0) would be materialized by a load, a copy or a merge. "
        "Save the tensors themselves (`tensor.contiguous()` or `.clone()` before torch.save), "
        "or with accel.save."
    )


def _member_count(file: IO[bytes]) -> int | None:
    """How many members the zip's end record lists, found as :mod:`zipfile` finds it (the
    record ending the file, else the last one in the final 64 KiB; its zip64 twin just before
    it), without reading the directory; ``None`` when there is none (``zipfile`` says why)."""
    size = file.seek(0, os.SEEK_END)
    tail = _read_at(file, max(0, size - _END.size), min(size, _END.size))
    at = len(tail) - _END.size
    if not (at >= 0 and tail[:4] == _END_MAGIC and tail[-2:] == b"\0\0"):  # a comment
        tail = _read_at(file, max(0, size - _TAIL), min(size, _TAIL))
        at = tail.rfind(_END_MAGIC)
        if at < 0 or len(tail) - at < _END.size:
            return None
    count: int = _END.unpack_from(tail, at)[4]
    if count == 0xFFFF:  # zip64: the locator (20 bytes) and the record (56) precede it
        start = size - len(tail) + at - 20 - 56
        record = _read_at(file, start, 56) if start >= 0 else b""
        if len(record) < 56 or record[:4] != b"PK\x06\x06":
            return None
        count = struct.unpack_from("<Q", record, 32)[0]
    return count


def check_torch_zip(file: IO[bytes], where: str) -> None:
    """Refuse a torch zip file that is compressed, inconsistent or declares other sizes.

    ``file`` is open for reading (its position is changed); ``where`` names it in messages.
    Reads the zip directory, the local headers and ``data.pkl``; decompresses nothing.

    Raises:
        CheckpointError: not a zip torch can read, more than :data:`MAX_MEMBERS` members,
            a member compressed, encrypted, out of the file, overlapping another or
            disagreeing with its local header, a storage missing or not of the size
            ``data.pkl`` declares (names the member), tensors of more than 8 times the file's
            size (plus 1 MiB) in full logical size (stride-0 views).
    """
    count = _member_count(file)
    size = file.seek(0, os.SEEK_END)
    if count is not None and count > MAX_MEMBERS:
        raise _refuse(
            where, f"its zip directory lists {count} members, more than the {MAX_MEMBERS} "
            "accel reads (torch.save writes one per tensor storage; save larger states as "
            "safetensors shards)"
        )
    try:
        with zipfile.ZipFile(file) as archive:
            infos, directory = archive.infolist(), archive.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, struct.error) as exc:
        raise CheckpointError(
            f"{where!r} is truncated, corrupted or unreadable: it starts like torch's zip "
            f"format but its zip directory cannot be read ({exc}). Write it again."
        ) from None
    if not infos or "/" not in infos[0].filename:
        raise _refuse(where, "its first member is not in an archive folder (ARCHIVE/data.pkl)")
    members: dict[str, tuple[int, int]] = {}
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        folded = info.filename.lower()  # torch's zip reader finds names ignoring case
        if folded in members:
            raise _refuse(where, f"member {info.filename!r} appears twice")
        start, end = _data_range(file, info, where)
        members[folded] = (start, end)
        spans.append((info.header_offset, end, info.filename))
    spans.sort()
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise _refuse(where, f"members {name!r} and {other!r} overlap")
    if spans[-1][1] > directory:
        raise _refuse(where, f"member {spans[-1][2]!r} runs into the zip directory or past the end")
    archive_dir = infos[0].filename.split("/", 1)[0]
    pickled = members.get(f"{archive_dir}/data.pkl".lower())
    if pickled is None:
        raise _refuse(where, f"it has no member {archive_dir + '/data.pkl'!r}")
    data = _read_at(file, pickled[0], pickled[1] - pickled[0])
    refuse = functools.partial(_refuse_pickle, where, "its data.pkl")
    inspector = inspect(io.BytesIO(data), len(data), refuse, tensor_budget=budget_for(size),
                        oversized=functools.partial(_oversized, where, "its data.pkl"))
    for key, nbytes in inspector.storages.items():
        name = f"{archive_dir}/data/{key}"
        found = members.get(name.lower())
        if found is None:
            raise _refuse(where, f"its data.pkl needs member {name!r}, which is missing")
        if found[1] - found[0] != nbytes:
            raise _refuse(
                where, f"member {name!r} holds {found[1] - found[0]} bytes but data.pkl "
                f"declares {nbytes}"
            )


@contextlib.contextmanager
def opened_torch_file(
    path: Path, where: str | None = None, *, follow_links: bool = True
) -> Iterator[tuple[IO[bytes], Path]]:
    """Open ``path`` once, check it (:func:`check_torch_zip`, or its pickles when it is not
    a zip), and give the open file and a path to *that* file for ``torch.load``
    (``/proc/self/fd/N`` on Linux, so a file swapped in after the check is not what torch
    reads; else ``path``).

    The file is opened without blocking (a FIFO is refused, not waited on) and must be a
    regular file; with ``follow_links=False`` a symbolic link is refused (inside a checkpoint
    whose format has none: DeepSpeed's directories). The file's position is at its start when
    given.

    Raises:
        CheckpointError: the file is not a regular file (or is a link, with
            ``follow_links=False``), or the zip or pickle check fails.
        OSError: the file cannot be opened (the caller says which file was wanted).
    """
    where = os.fspath(path) if where is None else where
    fd = open_regular(path, follow_links=follow_links)  # a FIFO or a device: refused, not read
    try:
        os.set_blocking(fd, True)
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        if is_zip(file):
            check_torch_zip(file, where)
        else:  # torch's format before zip, or a bare pickle: its pickles are checked alike
            check_legacy(file, where, functools.partial(_refuse_pickle, where, "its pickle"),
                         functools.partial(_oversized, where, "its pickle"))
        file.seek(0)
        own = Path(f"/proc/self/fd/{file.fileno()}")
        yield file, own if own.exists() else path


def is_zip(file: IO[bytes]) -> bool:
    """Whether the open ``file`` starts like a zip archive (torch's test; position kept)."""
    position = file.tell()
    try:
        return _read_at(file, 0, 4) == _LOCAL_MAGIC
    finally:
        file.seek(position)

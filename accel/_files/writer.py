"""Write a checkpoint's files in parallel, straight from the tensors' memory.

A save is first *planned*: each file is a list of parts (header bytes, tensors) at known
offsets. :func:`write_files` cuts every file into slices of 4 MiB and runs

* one *writer* thread per file (up to ``workers``), which writes the file's slices in order
  with ``os.pwrite`` from the tensor's own memory (no buffered copy) and asks the kernel to
  start writing each back (``sync_file_range``, Linux; skipped on tmpfs and ramfs, which have
  no device). One thread per file: writers of one file would only queue on its inode lock;
* one *checker* thread, which checksums slices ahead of the writers (CRC32, see
  :mod:`~accel._files.crc`).

Each slice is checksummed once, by whichever thread claims it first: a writer about to write
a slice that no checker has taken checksums it itself, while it is in the CPU cache. So with
an idle core the checksum runs beside the copy into the page cache (the save costs the copy),
and on a busy machine the writer does both with no thread hand-off. All three release the
GIL. The thread that finishes a file joins its slices' CRCs and fsyncs it while the others go
on with other files.

On a memory filesystem (tmpfs, ramfs) there is no device to overlap with: the save is the
copy itself (slices of 512 KiB there, not 4 MiB: ~4% less CPU time). A save whose files are
all small (JSON, RNG states, under 64 MiB each) is written in the calling thread, which
checksums every slice itself. With a file of 64 MiB or more, and two usable CPUs or more, a
checker runs beside the writers (one per large file, up to one fewer than the CPUs): the
checksum, ~25% of the copy's time with isal's CRC32 on this project's 2-core machines, then
runs beside the copy. Measured on /dev/shm against ``safetensors.save_file`` (median of 7,
model-only saves, 2 CPUs): one thread 1.33x / 1.29x at 0.1 / 0.5 GB, checker + writer
1.18x / 1.10x and 1.07x at 1.6 GB. (An earlier machine had measured the checker with four
threads 11-22% slower than one thread; with one CPU there is no checker.)
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import attrs
import torch

from accel._files import crc as _crc
from accel._files.crc import join_crcs
from accel._files.format import FileRecord, byte_view, on_host, safetensors_prefix
from accel._files.safe_io import open_write
from accel.core.settings import cpu_count
from accel.errors import CheckpointCancelledError

__all__ = ["PlannedFile", "plan_bytes", "plan_safetensors", "write_files"]

_SLICE = 4 << 20  # bytes written (and checksummed) at once: stays in the CPU cache
WORKERS = 4  # threads: one checker and up to three writers (one file each)
_OWN_THREAD = 64 << 20  # on a memory filesystem: the smallest file given a writer of its own
_MEMORY_SLICE = 512 << 10  # on a memory filesystem: checksummed, then copied from the L2 cache
_SYNC_FILE_RANGE_WRITE = 2

Part = bytes | torch.Tensor


@attrs.define
class PlannedFile:
    """One file of a save: where it goes, its manifest name, its parts in order, its size."""

    path: Path
    name: str
    parts: list[Part]
    size: int


def plan_safetensors(tmp: Path, name: str, tensors: dict[str, torch.Tensor]) -> PlannedFile:
    """The plan of a safetensors file ``tmp / name`` holding ``tensors`` in order."""
    prefix, data = safetensors_prefix(tensors)
    return PlannedFile(tmp / name, name, [prefix, *tensors.values()], len(prefix) + data)


def plan_bytes(tmp: Path, name: str, data: bytes) -> PlannedFile:
    """The plan of a file ``tmp / name`` holding ``data``."""
    return PlannedFile(tmp / name, name, [data], len(data))


def _start_writeback() -> Callable[[int, int, int], None]:
    """``sync_file_range(fd, offset, n, WRITE)`` where libc has it, else nothing."""
    if sys.platform.startswith("linux"):
        try:
            function = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (OSError, AttributeError):
            function = None
        if function is not None:
            function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            function.restype = ctypes.c_int

            def start(fd: int, offset: int, length: int) -> None:
                function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # advisory: errors ignored

            return start
    return lambda fd, offset, length: None


_writeback = _start_writeback()

# Filesystems held in memory (no device to write back to): tmpfs, ramfs.
_MEMORY_FILESYSTEMS = frozenset({0x01021994, 0x858458F6})


def _fstatfs_type() -> Callable[[int], int | None]:
    """``fstatfs(fd).f_type`` where libc has it (Linux), else ``None``."""
    if sys.platform.startswith("linux"):
        try:
            function = ctypes.CDLL(None, use_errno=True).fstatfs
        except (OSError, AttributeError):
            function = None
        if function is not None:
            function.argtypes = [ctypes.c_int, ctypes.c_void_p]
            function.restype = ctypes.c_int

            def kind(fd: int) -> int | None:
                buffer = (ctypes.c_long * 32)()  # struct statfs: f_type comes first
                if function(fd, buffer) != 0:
                    return None
                return int(buffer[0]) & 0xFFFFFFFF

            return kind
    return lambda fd: None


_fs_type = _fstatfs_type()


def in_memory(fd: int) -> bool:
    """Whether ``fd``'s file lives on a memory filesystem (tmpfs, ramfs): no writeback."""
    return _fs_type(fd) in _MEMORY_FILESYSTEMS


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _Slice:
    """Up to ``_SLICE`` bytes of one part of a file (``view``), written by the file's writer
    thread and checksummed by whichever thread claims it first (``claimed``, set under the
    write's claim lock). A device or strided tensor is one item with no view (``part``): its
    writer copies it to the host when it gets there, then writes and checksums the copy."""

    __slots__ = ("claimed", "crc", "length", "offset", "part", "view")

    def __init__(self, view: memoryview | None, offset: int, length: int,
                 part: torch.Tensor | None = None) -> None:
        self.view, self.offset, self.length, self.part = view, offset, length, part
        self.claimed = part is not None  # only its writer can read a host copy
        self.crc = 0


class _File:
    """One file being written: its slices, and how many writes and checksums are left; the
    thread that completes the last one fsyncs it and records its size and CRC."""

    def __init__(self, planned: PlannedFile, fd: int) -> None:
        self.planned, self.fd = planned, fd
        self.writeback = not in_memory(fd)  # a memory filesystem has no device to start
        self.slices = _slices(planned, None if self.writeback else _MEMORY_SLICE)
        self.left = 2 * len(self.slices)  # a write and a checksum each
        self.lock = threading.Lock()
        self.record: FileRecord | None = None

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.finish()

    def finish(self) -> None:
        os.fsync(self.fd)
        crc = join_crcs([(s.length, s.crc) for s in self.slices])
        self.record = FileRecord(name=self.planned.name, size=self.planned.size, crc32=crc)


def _slices(planned: PlannedFile, size: int | None = None) -> list[_Slice]:
    """The file's slices of ``size`` bytes (default ``_SLICE``) in order (nothing is copied)."""
    size = _SLICE if size is None else size
    slices: list[_Slice] = []
    offset = 0
    for part in planned.parts:
        if isinstance(part, bytes):
            view = memoryview(part)
        elif part.device.type == "cpu" and part.is_contiguous():
            view = byte_view(part.detach())  # the tensor's own memory
        else:
            size = part.numel() * part.element_size()
            if size:
                slices.append(_Slice(None, offset, size, part))
            offset += size
            continue
        for start in range(0, len(view), size):
            piece = view[start : start + size]
            slices.append(_Slice(piece, offset + start, len(piece)))
        offset += len(view)
    return slices


class _Run:
    """The threads' shared state: the files, the claim lock, the first error, the stop flag."""

    def __init__(self, files: list[_File], stop: threading.Event) -> None:
        self.files, self.stop = files, stop
        self.claims = threading.Lock()
        self.errors: list[BaseException] = []

    def claim(self, piece: _Slice) -> bool:
        """Take ``piece`` for checksumming; ``False`` when another thread already has."""
        with self.claims:
            if piece.claimed:
                return False
            piece.claimed = True
            return True

    def guarded(self, work: Callable[[], None]) -> None:
        if self.errors:
            return
        try:
            work()
        except BaseException as exc:
            self.errors.append(exc)
            self.stop.set()

    def write(self, file: _File) -> None:
        """The file's writer: every slice in order, checksumming those no checker took."""
        fd, checksum, writeback, stop = file.fd, _crc.crc32, file.writeback, self.stop
        for piece in file.slices:
            if stop.is_set():
                return
            if piece.view is None:  # a device or strided tensor: its host copy, then freed
                assert piece.part is not None
                host = on_host(piece.part)  # kept alive by this name while its view is used
                view, crc = byte_view(host), 0
                for start in range(0, len(view), _SLICE):
                    if stop.is_set():
                        return
                    chunk = view[start : start + _SLICE]
                    crc = checksum(chunk, crc)
                    _pwrite_all(fd, chunk, piece.offset + start)
                    if writeback:
                        _writeback(fd, piece.offset + start, len(chunk))
                piece.crc = crc
                del view, host
                file.done()
            else:
                if self.claim(piece):
                    piece.crc = checksum(piece.view)
                    file.done()
                _pwrite_all(fd, piece.view, piece.offset)
                if writeback:
                    _writeback(fd, piece.offset, piece.length)
            file.done()

    def check(self) -> None:
        """The checker: checksums slices of every file, in order, ahead of their writers."""
        checksum, stop = _crc.crc32, self.stop
        for file in self.files:
            for piece in file.slices:
                if stop.is_set():
                    return
                if self.claim(piece):
                    assert piece.view is not None
                    piece.crc = checksum(piece.view)
                    file.done()


def _threads(busy: list[_File], workers: int) -> tuple[int, bool]:
    """How many writer threads, and whether a checker runs beside them.

    On a disk: a writer per file (up to ``workers - 1``) and a checker. On a memory
    filesystem (every file): a save with no file of at least 64 MiB is written in the calling
    thread (no checker); with one, a checker beside a writer per such file (up to
    ``workers - 1`` and one fewer than the usable CPUs) where the process has two CPUs or
    more; with one CPU, one writer that checksums its own slices.
    """
    if not busy or workers <= 1:
        return 1, False
    if any(file.writeback for file in busy):
        return min(len(busy), workers - 1), True
    large = sum(file.planned.size >= _OWN_THREAD for file in busy)
    cpus = cpu_count()
    if large == 0 or cpus < 2:
        return 1, False
    return max(1, min(large, workers - 1, cpus - 1)), True


def write_files(
    files: Sequence[PlannedFile],
    *,
    workers: int = WORKERS,
    cancelled: threading.Event | None = None,
) -> list[FileRecord]:
    """Write and fsync every planned file, in parallel; their records, in the files' order.

    ``workers`` bounds the threads (one checker, the rest writers, one file at a time each;
    on a memory filesystem no checker, and a writer per file of 64 MiB or more);
    ``workers=1`` writes and checksums every file in the calling thread.

    On an error the remaining work stops and the first error is raised; the partly written
    files stay where they are (in the save's temporary directory, removed by its caller).
    Setting ``cancelled`` stops the writing the same way, with a ``CheckpointCancelledError``
    (an ``InterruptedError``).
    """
    stop = cancelled if cancelled is not None else threading.Event()
    opened: list[_File] = []
    try:
        for planned in files:
            fd = open_write(planned.path)  # never through a link, only a regular file
            file = _File(planned, fd)
            opened.append(file)
            if not file.slices:  # an empty file: nothing to write, still made durable
                file.finish()
        busy = [file for file in opened if file.slices]
        run = _Run(busy, stop)
        writers, checker = _threads(busy, workers)
        if writers <= 1 and not checker:  # one thread: the writer checksums every slice
            for file in busy:
                run.guarded(partial(run.write, file))
        else:
            with ThreadPoolExecutor(max_workers=writers + checker) as pool:
                jobs = [pool.submit(run.guarded, run.check)] if checker else []
                jobs += [pool.submit(run.guarded, partial(run.write, f)) for f in busy]
                for job in jobs:
                    job.result()
        if run.errors:
            raise run.errors[0]
        if stop.is_set():
            raise CheckpointCancelledError(
                f"The checkpoint write of {len(opened)} file(s) was cancelled before it "
                "finished; nothing was made visible. Save again to write a checkpoint."
            )
        return [file.record for file in opened if file.record is not None]
    finally:
        for file in opened:
            os.close(file.fd)

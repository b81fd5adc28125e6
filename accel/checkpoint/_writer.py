"""Write a checkpoint's files in parallel, straight from the tensors' memory.

A save is first *planned*: each file is a list of parts (header bytes, tensors) at known
offsets. :func:`write_files` then cuts every file into tasks of up to 32 MiB and runs them on a
few threads: each task checksums a slice (``zlib.crc32``), writes it with ``os.pwrite`` from the
tensor's own memory (no buffered copy) and asks the kernel to start writing it back
(``sync_file_range``, Linux), so checksumming, copying into the page cache and the disk's work
overlap, within a file and across files (all three release the GIL). The task that finishes a
file joins its parts' CRCs and fsyncs it while the other threads go on with other files.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import torch

from accel.checkpoint._crc import join_crcs
from accel.checkpoint._format import FileRecord, _host, _view, safetensors_prefix
from accel.checkpoint._safe_io import open_write
from accel.errors import CheckpointCancelledError

__all__ = ["PlannedFile", "plan_bytes", "plan_safetensors", "write_files"]

TASK = 32 << 20  # bytes of one thread task
_SLICE = 4 << 20  # checksummed then written while still in the CPU cache
WORKERS = 4  # threads: they mostly wait for memory and the disk, so more than the cores
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


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


class _Task:
    """A byte range of one part of one file: checksummed and written by one thread."""

    __slots__ = ("file", "offset", "part", "start", "stop")

    def __init__(self, file: _File, offset: int, part: Part, start: int, stop: int) -> None:
        self.file, self.offset, self.part, self.start, self.stop = file, offset, part, start, stop

    def run(self, cancelled: threading.Event) -> None:
        part = self.part
        if isinstance(part, bytes):
            view = memoryview(part)
        else:
            host = _host(part)  # CPU contiguous tensors: the tensor itself, no copy
            view = _view(host)
        view = view[self.start : self.stop]
        crc, fd, offset = 0, self.file.fd, self.offset
        for begin in range(0, len(view), _SLICE):
            if cancelled.is_set():
                return
            piece = view[begin : begin + _SLICE]
            crc = zlib.crc32(piece, crc)
            _pwrite_all(fd, piece, offset + begin)
            _writeback(fd, offset + begin, len(piece))
        self.file.done(self.offset, len(view), crc)


class _File:
    """Progress of one file: the CRCs of its finished tasks; the last one fsyncs it."""

    def __init__(self, planned: PlannedFile, fd: int, tasks: int) -> None:
        self.planned, self.fd, self.left = planned, fd, tasks
        self.crcs: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()
        self.record: FileRecord | None = None

    def done(self, offset: int, length: int, crc: int) -> None:
        with self.lock:
            self.crcs.append((offset, length, crc))
            self.left -= 1
            last = self.left == 0
        if last:
            self.finish()

    def finish(self) -> None:
        os.fsync(self.fd)
        crc = join_crcs([(length, c) for _, length, c in sorted(self.crcs)])
        self.record = FileRecord(name=self.planned.name, size=self.planned.size, crc32=crc)


def _tasks(file: _File) -> list[_Task]:
    tasks: list[_Task] = []
    offset = 0
    for part in file.planned.parts:
        if isinstance(part, bytes):
            size = len(part)
            split = True
        else:
            size = part.numel() * part.element_size()
            split = part.device.type == "cpu" and part.is_contiguous()
        if size == 0:
            continue
        step = TASK if split else size  # a device tensor is copied to the host once
        tasks += [
            _Task(file, offset + start, part, start, min(size, start + step))
            for start in range(0, size, step)
        ]
        offset += size
    return tasks


def write_files(
    files: Sequence[PlannedFile],
    *,
    workers: int = WORKERS,
    cancelled: threading.Event | None = None,
) -> list[FileRecord]:
    """Write and fsync every planned file, in parallel; their records, in the files' order.

    On an error the remaining tasks stop and the first error is raised; the partly written
    files stay where they are (in the save's temporary directory, removed by its caller).
    Setting ``cancelled`` stops the writing the same way, with a ``CheckpointCancelledError`` (an
    ``InterruptedError``).
    """
    stop = cancelled if cancelled is not None else threading.Event()
    opened: list[_File] = []
    try:
        tasks: list[_Task] = []
        for planned in files:
            fd = open_write(planned.path)  # never through a link, only a regular file
            file = _File(planned, fd, 0)
            opened.append(file)
            mine = _tasks(file)
            file.left = len(mine)
            if not mine:  # an empty file: nothing to write, still made durable
                file.finish()
            tasks += mine
        errors: list[BaseException] = []

        def run(task: _Task) -> None:
            if errors:
                return
            try:
                task.run(stop)
            except BaseException as exc:
                errors.append(exc)
                stop.set()

        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks)))) as pool:
            for _ in pool.map(run, tasks):
                pass
        if errors:
            raise errors[0]
        if stop.is_set():
            raise CheckpointCancelledError(
                f"The checkpoint write of {len(opened)} file(s) was cancelled before it "
                "finished; nothing was made visible. Save again to write a checkpoint."
            )
        return [file.record for file in opened if file.record is not None]
    finally:
        for file in opened:
            os.close(file.fd)

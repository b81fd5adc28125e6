"""Streaming safetensors files: write and read tensor by tensor, with a CRC32 of the file.

The files are plain safetensors (``safetensors.torch.load_file`` reads them). Writing goes
tensor by tensor straight from each tensor's memory, so saving holds no second copy of the
weights; the CRC32 of every byte is computed on the way and recorded in the manifest.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, NamedTuple

import attrs
import torch

from accel._files.crc import crc32_parallel
from accel._files.safe_io import MAX_JSON_BYTES, load_json, open_regular, open_write
from accel.errors import CheckpointError

__all__ = [
    "DTYPE_NAMES",
    "NAMED_DTYPES",
    "FileRecord",
    "byte_view",
    "fsync_dir",
    "map_safetensors",
    "on_host",
    "read_safetensors",
    "safetensors_prefix",
    "write_bytes",
    "write_safetensors",
]

#: The safetensors name of every dtype the format stores (``torch.float32`` -> ``"F32"``).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
#: The dtype of each safetensors name (``"F32"`` -> ``torch.float32``).
NAMED_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_CHUNK = 64 << 20  # CRC and write granularity for big tensors
_PARALLEL_CHECK = 64 << 20  # files larger than this are checksummed by several threads
_CHECKERS = 4
_MAX_DIMS = 64  # more dimensions than any tensor has: a header asking for more is crafted
_INT64_MAX = 2**63 - 1


@attrs.frozen
class FileRecord:
    """A written file: path relative to the checkpoint, size in bytes and CRC32."""

    name: str
    size: int
    crc32: int


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (caller keeps it alive).

    Example:
        >>> byte_view(torch.ones(2, dtype=torch.uint8)).tobytes()
        b'\\x01\\x01'
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, on the CPU and contiguous (copied only where it is not already),
    ready for :func:`byte_view`.

    Example:
        >>> on_host(torch.ones(2, 3).t()).is_contiguous()
        True
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def _write_all(f: BinaryIO, data: memoryview, crc: int) -> int:
    for start in range(0, len(data), _CHUNK):
        chunk = data[start : start + _CHUNK]
        crc = zlib.crc32(chunk, crc)
        f.write(chunk)
    return crc


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so renames and new entries in it survive a crash."""
    if sys.platform == "win32":  # directories cannot be opened for fsync there
        return
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_prefix(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, int]:
    """The 8-byte length and JSON header of a safetensors file, and its data section's size.

    Tensors are laid out back to back in the order given.

    Raises:
        CheckpointError: a dtype safetensors cannot store, or a big-endian machine.
    """
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this machine is not.")
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise CheckpointError(
                f"Tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store. "
                f"Convert it first, e.g. `tensor.to(torch.float32)`."
            )
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    return prefix, offset


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    root: str | os.PathLike[str] | None = None,
    durable: bool = True,
) -> FileRecord:
    """Write ``tensors`` as a safetensors file, fsync it, and return its record.

    Tensors are written in the order given; device and non-contiguous tensors are copied to
    the host one at a time. ``durable=False`` (scratch files such as offloaded weights)
    skips the checksum (the record's ``crc32`` is 0) and the fsync.
    """
    prefix, offset = safetensors_prefix(tensors, metadata)
    with os.fdopen(open_write(path), "wb") as f:  # never through a link
        crc = zlib.crc32(prefix) if durable else 0
        f.write(prefix)
        for tensor in tensors.values():
            host = on_host(tensor)
            if durable:
                crc = _write_all(f, byte_view(host), crc)
            else:
                f.write(byte_view(host))
            del host
        if durable:
            f.flush()
            os.fsync(f.fileno())
    name = os.fspath(path) if root is None else os.path.relpath(path, root)
    return FileRecord(name=name, size=len(prefix) + offset, crc32=crc)


def write_bytes(
    path: str | os.PathLike[str], data: bytes, *, root: str | os.PathLike[str] | None = None
) -> FileRecord:
    """Write ``data`` to ``path`` (never through a link), fsync it, and return its record."""
    with os.fdopen(open_write(path), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    name = os.fspath(path) if root is None else os.path.relpath(path, root)
    return FileRecord(name=name, size=len(data), crc32=zlib.crc32(data))


def _corrupt(path: str | os.PathLike[str], what: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint file {os.fspath(path)!r} is corrupted or truncated: {what}. Load an "
        "earlier checkpoint (`accel.latest_checkpoint()` skips incomplete ones) or save again."
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(path: str | os.PathLike[str], name: str, info: object) -> None:
    """One header entry: a known dtype, a shape of counts, offsets spanning exactly it.

    A shape must also be one torch can build: at most 64 dimensions, whose product (zero
    dimensions counted as one, as strides are) times the element size fits in an int64.
    """
    if not isinstance(info, dict):
        raise _corrupt(path, f"the header entry of tensor {name!r} is {info!r:.80}")
    name_of = info.get("dtype")
    dtype = NAMED_DTYPES.get(name_of) if isinstance(name_of, str) else None
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise _corrupt(path, f"tensor {name!r} has the unknown dtype {info.get('dtype')!r:.40}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _corrupt(path, f"tensor {name!r} has the invalid shape {shape!r:.80}")
    if len(shape) > _MAX_DIMS:
        raise _corrupt(path, f"tensor {name!r} has {len(shape)} dimensions (at most {_MAX_DIMS})")
    span = dtype.itemsize
    for dim in shape:
        span *= max(dim, 1)
        if span > _INT64_MAX:
            raise _corrupt(
                path, f"tensor {name!r} has the shape {shape!r:.80}, too large for any tensor"
            )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise _corrupt(path, f"tensor {name!r} has invalid data offsets {offsets!r:.80}")
    numel = 1
    for dim in shape:
        numel *= dim
    if offsets[1] - offsets[0] != numel * dtype.itemsize:
        raise _corrupt(
            path,
            f"tensor {name!r} of shape {shape} and dtype {info['dtype']} needs "
            f"{numel * dtype.itemsize} bytes, its offsets span {offsets[1] - offsets[0]}",
        )


class SafetensorsMap(NamedTuple):
    """A safetensors file mapped privately, with its checked header."""

    mapped: mmap.mmap
    base: int  # offset of the data section (8 + header length)
    entries: list[tuple[str, dict[str, Any]]]  # by data offset: dtype, shape, data_offsets
    metadata: dict[str, str]


def map_safetensors(
    path: str | os.PathLike[str],
    *,
    open_path: str | os.PathLike[str] | None = None,
    bad: Callable[[str | os.PathLike[str], str], CheckpointError] = _corrupt,
    follow_links: bool = True,
    expected_size: int | None = None,
) -> SafetensorsMap:
    """Map a safetensors file copy-on-write and check its header against its size.

    Every entry is checked (dtype, shape, offsets spanning exactly its bytes), entries lie
    back to back and end at the end of the file. Problems are ``bad(path, what)`` errors.
    ``open_path`` is where to open the file when it differs from ``path`` (a temporary file
    about to be renamed to ``path``). Only a regular file is opened (a FIFO or a device is
    refused before anything is read); ``follow_links=False`` refuses a symbolic link too (files
    inside a ``save_state`` checkpoint). ``expected_size`` is the size a manifest declares:
    another size is refused before the file is mapped.

    Raises:
        CheckpointError: the file is a link (``follow_links=False``), not a regular file, of
            another size than ``expected_size``, or malformed.
        OSError: it cannot be opened or mapped.
    """
    where = path if open_path is None else open_path
    fd = open_regular(where, follow_links=follow_links)
    try:
        size = os.fstat(fd).st_size
        if expected_size is not None and size != expected_size:
            raise CheckpointError(
                f"Checkpoint file {os.fspath(path)!r} has {size} bytes, the manifest says "
                f"{expected_size}: it is truncated or corrupted. Load an earlier checkpoint."
            )
        if size < 8:
            raise bad(path, f"only {size} bytes")
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    (header_len,) = struct.unpack("<Q", mapped[:8])
    if header_len > size - 8:
        raise bad(path, f"header of {header_len} bytes in a file of {size}")
    if header_len > MAX_JSON_BYTES:
        raise bad(path, f"header of {header_len} bytes, more than the {MAX_JSON_BYTES} accel reads")
    header = load_json(
        mapped[8 : 8 + header_len], lambda problem: bad(path, f"unreadable header ({problem})")
    )
    if not isinstance(header, dict):
        raise bad(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise bad(path, "its __metadata__ is not a JSON object")
    base = 8 + header_len
    for name, info in header.items():
        _check_entry(path, name, info)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    position = 0
    for name, info in entries:
        start, end = info["data_offsets"]
        if start != position:
            raise bad(path, f"bad data offsets for tensor {name!r}: {info}")
        position = end
    if base + position != size:
        what = "cut short" if base + position > size else "trailing bytes after the last tensor"
        raise bad(path, f"{what} ({size} bytes, the header describes {base + position})")
    return SafetensorsMap(mapped, base, entries, {str(k): str(v) for k, v in metadata.items()})


def _checksum(mapped: mmap.mmap) -> int:
    """CRC32 of a mapped file; parts of a large one on several threads (zlib drops the GIL)."""
    view = memoryview(mapped)
    try:
        if len(view) <= _PARALLEL_CHECK:
            return crc32_parallel(view, None)
        with ThreadPoolExecutor(max_workers=_CHECKERS) as pool:
            return crc32_parallel(view, pool)
    finally:
        view.release()


def read_safetensors(
    path: str | os.PathLike[str],
    *,
    expected_crc32: int | None = None,
    expected_size: int | None = None,
    follow_links: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map a safetensors file and return its tensors, after checking structure and CRC32.

    The tensors are views of a private (copy-on-write) memory map of the file: no copy is
    made until something writes to them, and changes never reach the file. Tensors whose
    offset is not aligned for their dtype are copied.

    ``expected_size`` and ``follow_links`` are as for :func:`map_safetensors`.

    Raises:
        CheckpointError: the file is missing, truncated, malformed, not a regular file (or
            a link, with ``follow_links=False``), or its CRC32 differs.
    """
    mapped, base, entries, metadata = map_safetensors(
        path, follow_links=follow_links, expected_size=expected_size
    )
    if expected_crc32 is not None:
        crc = _checksum(mapped)
        if crc != expected_crc32:
            raise _corrupt(
                path, f"CRC32 {crc:#010x} is not the manifest's {expected_crc32:#010x}"
            )
    tensors: dict[str, torch.Tensor] = {}
    for name, info in entries:
        start, end = info["data_offsets"]
        dtype = NAMED_DTYPES[info["dtype"]]
        if end == start:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - start, offset=base + start)
        if (base + start) % dtype.itemsize:
            raw = raw.clone()
        tensors[name] = raw.view(dtype).reshape(info["shape"])
    return tensors, metadata

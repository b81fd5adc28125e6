"""Offloaded weights: pickle-free files on disk, read back on demand.

Weights placed on ``"disk"`` live in safetensors files: a checkpoint shard used where it is,
or a file :func:`write_offload_file` wrote into the offload folder. :class:`MappedFile` opens
a file once and keeps it open:

* a forward reads each weight with ``pread`` into memory of its own (:meth:`MappedFile.read`),
  after checking the file still has the size it had. A file truncated, cut short or grown by
  another process while the model lives is then a :class:`~accel.errors.CheckpointError`,
  never a ``SIGBUS`` (which is what touching a memory map past the new end of its file does);
  a file replaced by a rename is not seen at all (the open file is the old one);
* :meth:`MappedFile.tensor` is a view of a private (copy-on-write) map of the file, made
  once and read lazily: what ``state_dict()`` of an offloaded model returns, so saving a
  model larger than memory reads one page at a time. Writing to such a view never reaches
  the file. These views read the file's pages when used, so a file truncated while one is
  read still ends the process with ``SIGBUS``, as with any memory map (``safetensors``'
  own, ``torch.load(mmap=True)``). :meth:`MappedFile.releaser` gives its pages back after a
  forward so resident memory stays at one module's weights.
"""

from __future__ import annotations

import functools
import mmap
import os
import stat
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from accel._files.atomic import write_file_atomically
from accel._files.format import DTYPE_NAMES, NAMED_DTYPES, map_safetensors, write_safetensors
from accel._files.safe_io import pread_into
from accel.errors import CheckpointError

__all__ = ["MappedFile", "TensorSource", "give_back", "map_sources", "write_offload_file"]

OFFLOAD_FILE = "accel-offload.safetensors"
_PAGE = mmap.PAGESIZE
_RELEASE_MIN = 64 << 10  # smaller tensors keep their pages: refaulting costs more than they hold
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_SPARE_MIN = 1 << 20  # smaller buffers come from malloc's own free lists


@attrs.frozen
class TensorSource:
    """Where one offloaded tensor's bytes live: tensor ``key`` of safetensors file ``path``
    (a checkpoint shard mapped in place, or a file in the offload folder), cast to ``dtype``
    when it is given and the tensor is floating point."""

    path: Path
    key: str
    dtype: torch.dtype | None = None


@attrs.frozen
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


def _bad_file(path: str | os.PathLike[str], what: str) -> CheckpointError:
    return CheckpointError(
        f"Weights file {os.fspath(path)!r} is not a valid safetensors file: {what}. Write it "
        "again (e.g. with `safetensors.torch.save_file` or `accel.save_model`)."
    )


class MappedFile:
    """A safetensors file mapped privately (copy-on-write), with tensors as views of it.

    Args:
        path: The file's name (shown in messages and recorded in sources).
        open_path: Where to open it, when that differs from ``path`` (a temporary file
            about to be renamed to ``path``).

    Raises:
        CheckpointError: the file is missing, truncated or not safetensors.

    Example:
        >>> mapped = MappedFile(Path("model.safetensors"))
        >>> mapped.tensor("fc.weight").shape
        torch.Size([4, 4])
    """

    def __init__(self, path: Path, *, open_path: Path | None = None) -> None:
        self.path = path
        if sys.byteorder != "little":
            raise CheckpointError("safetensors files are little-endian; this machine is not.")
        where = path if open_path is None else open_path
        try:
            fd = _open_regular(where, path)
            try:
                own = f"/proc/self/fd/{fd}"  # the open file itself, whatever its name is now
                mapped, base, entries, _ = map_safetensors(
                    path, open_path=own if os.path.exists(own) else where, bad=_bad_file
                )
                self._size = os.fstat(fd).st_size
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            raise CheckpointError(
                f"Cannot open weights file {os.fspath(path)!r} ({exc.strerror or exc}). Check "
                "the path, or load the checkpoint again if it was moved."
            ) from None
        self._fd = fd
        weakref.finalize(self, os.close, fd)
        self._mm: mmap.mmap | None = mapped
        self._entries: dict[str, _Entry] = {
            key: _Entry(
                NAMED_DTYPES[info["dtype"]],
                tuple(info["shape"]),
                base + info["data_offsets"][0],
                base + info["data_offsets"][1],
            )
            for key, info in entries
        }
        self._views: dict[str, torch.Tensor] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """The tensor names in the file."""
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor ``key``."""
        return self._entries[key].shape

    def dtype(self, key: str) -> torch.dtype:
        """The dtype of tensor ``key`` as stored."""
        return self._entries[key].dtype

    def is_mapped(self, key: str) -> bool:
        """Whether ``tensor(key)`` is a view of the file (not a copy: misaligned data is
        copied once, as CPU kernels need aligned memory)."""
        entry = self._entries[key]
        return entry.end > entry.start and entry.start % entry.dtype.itemsize == 0

    def tensor(self, key: str) -> torch.Tensor:
        """Tensor ``key``: a view of the private mapping (the same object on every call).

        Writes to it change this process's copy of the pages only, never the file.
        """
        view = self._views.get(key)
        if view is None:
            entry = self._entries[key]
            if entry.end == entry.start:
                view = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
            else:
                assert self._mm is not None
                raw = torch.frombuffer(
                    self._mm, dtype=torch.uint8, count=entry.end - entry.start, offset=entry.start
                )
                if not self.is_mapped(key):
                    raw = raw.clone()
                view = raw.view(entry.dtype).reshape(entry.shape)
            self._views[key] = view
        return view

    def read(self, key: str, *, spare: bool = False) -> torch.Tensor:
        """Tensor ``key`` read from the open file (``pread``) into memory of its own.

        Nothing here touches the memory map, so a file changed by another process cannot
        crash the reader: it is an error instead. With ``spare=True`` the memory may be a
        buffer an earlier read gave back (:func:`give_back`), which saves the page faults of
        fresh memory; the caller then gives it back when done.

        Raises:
            CheckpointError: the file's size changed since it was opened (truncated, cut
                short or rewritten), or it ended before the tensor's bytes.
        """
        entry = self._entries[key]
        size = os.fstat(self._fd).st_size
        if size != self._size:
            raise self._changed(f"it has {size} bytes now, {self._size} when it was loaded")
        nbytes = entry.end - entry.start
        if nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
        raw = _SPARES.take(nbytes) if spare else _host_bytes(nbytes)
        buffer = raw.numpy().data  # a writable memoryview of the tensor's bytes
        done = 0
        while done < nbytes:
            got = pread_into(self._fd, buffer[done:], entry.start + done)
            if got <= 0:
                if spare:
                    _SPARES.give(raw)
                raise self._changed(f"it ended before the {nbytes} bytes of tensor {key!r}")
            done += got
        return raw.view(entry.dtype).reshape(entry.shape)

    def _changed(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"Offloaded weights file {os.fspath(self.path)!r} changed while the model was "
            f"using it: {what}. Another process truncated or rewrote it. Keep the offload "
            "folder and the checkpoint unchanged while a model dispatched from them lives, "
            "then load the model again."
        )

    def releaser(self, key: str) -> Callable[[], None] | None:
        """A function that gives back the resident pages only tensor ``key`` spans (they are
        read from the file again on next use; changes made to them in memory are dropped),
        or ``None`` when that is not worth it (under 64 KiB of whole pages), not possible (a
        copied tensor) or not supported (no ``madvise``)."""
        if _DONTNEED is None or self._mm is None or not self.is_mapped(key):
            return None
        entry = self._entries[key]
        first = -(-entry.start // _PAGE) * _PAGE  # pages wholly inside the tensor
        last = entry.end // _PAGE * _PAGE
        if last - first < _RELEASE_MIN:
            return None
        return functools.partial(self._mm.madvise, _DONTNEED, first, last - first)


class _Spares:
    """Buffers of big tensors read for forwards, kept for the next read of the same size.

    Fresh memory costs a page fault (and zeroing) per page on first touch, several times the
    read itself for large tensors; a forward's weights are the same sizes layer after layer.
    The buffers kept never exceed the most a forward had taken at once (one module's
    weights), and one is reused only when nothing else holds its memory (a tensor kept by
    autograd or by the caller is left alone).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0  # bytes in _free
        self._out = 0  # bytes taken and not given back
        self._peak = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._out += nbytes
            self._peak = max(self._peak, self._out)
            free = self._free.get(nbytes, [])
            while free:
                raw = free.pop()
                self._kept -= nbytes
                if _unshared(raw):
                    return raw
        with torch.inference_mode(False):  # a normal tensor: it may serve a forward with grad
            return _host_bytes(nbytes)

    def give(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        with self._lock:
            self._out = max(self._out - nbytes, 0)
            if nbytes < _SPARE_MIN or self._kept + nbytes > self._peak or _COUNT is None:
                return
            with torch.inference_mode(False):
                raw = torch.empty(0, dtype=torch.uint8, device="cpu").set_(storage)
            self._free.setdefault(nbytes, []).append(raw)
            self._kept += nbytes


def _host_bytes(nbytes: int) -> torch.Tensor:
    """Fresh CPU memory (whatever the default device of the caller's context)."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu")


def _unshared(raw: torch.Tensor) -> bool:
    """Whether ``raw`` is the only tensor on its memory (the count includes the temporary
    storage object asked for here)."""
    return _COUNT is not None and _COUNT(raw.untyped_storage()._cdata) <= 2


_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
_SPARES = _Spares()


def give_back(tensor: torch.Tensor) -> None:
    """Hand back the memory of a tensor ``MappedFile.read(..., spare=True)`` returned (or a
    view of it) once the caller is done with it; it may serve a later read."""
    if tensor.device.type == "cpu":
        _SPARES.give(tensor)


def _open_regular(where: Path, path: Path) -> int:
    """A read-only descriptor of ``where``, which must be a regular file (opened without
    blocking: a FIFO is refused, not waited on)."""
    fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    map_safetensors(path, open_path=where, bad=_bad_file).mapped.close()  # says what it is
    raise _bad_file(path, "it is not a regular file")


def map_sources(
    sources: Mapping[str, TensorSource],
    shapes: Mapping[str, tuple[int, ...]],
    files: dict[Path, MappedFile] | None = None,
) -> dict[str, tuple[MappedFile, str]]:
    """Map the file of every source once and check it: the file exists and is safetensors,
    holds the key, with the shape in ``shapes`` (the model's tensor of that name).

    Args:
        sources: By model name, where the tensor's bytes are.
        shapes: By model name, the shape the model expects.
        files: Files mapped already, by path; updated in place.

    Returns:
        By model name, the mapped file and the key in it.

    Raises:
        CheckpointError: a missing or invalid file, a missing key, or a shape mismatch (the
            message names the key and both shapes).

    Example:
        >>> found = map_sources({"fc.weight": TensorSource(Path("m.safetensors"), "fc.weight")},
        ...                     {"fc.weight": (4, 4)})
    """
    files = {} if files is None else files
    out: dict[str, tuple[MappedFile, str]] = {}
    for name, source in sources.items():
        path = Path(os.path.abspath(source.path))
        mapped = files.get(path)
        if mapped is None:
            if not path.is_file():
                raise CheckpointError(
                    f"The weights of {name!r} are to be read from {os.fspath(source.path)!r}, "
                    "which does not exist. Load the model again from a checkpoint that exists."
                )
            mapped = files[path] = MappedFile(path)
        if source.key not in mapped:
            raise CheckpointError(
                f"Weights file {os.fspath(path)!r} has no tensor {source.key!r} (needed for "
                f"{name!r}); it holds {len(mapped.keys())} tensors, e.g. "
                f"{mapped.keys()[:5]!r}. Check that the checkpoint matches the model."
            )
        expected = tuple(shapes[name])
        if mapped.shape(source.key) != expected:
            raise CheckpointError(
                f"Shape mismatch for {name!r}: tensor {source.key!r} of "
                f"{os.fspath(path)!r} has shape {list(mapped.shape(source.key))}, the model "
                f"expects {list(expected)}. Check that the checkpoint matches the model."
            )
        out[name] = (mapped, source.key)
    return out


def _write(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """A plain safetensors file, written tensor by tensor from each tensor's memory.

    Offload files are scratch space remade at each dispatch, so no checksum and no fsync.
    """
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise CheckpointError(
                f"Cannot offload {name!r} to disk: its dtype {tensor.dtype} has no safetensors "
                "code. Keep its module on a device (`device_map={..., name: 'cpu'}`)."
            )
    write_safetensors(path, tensors, metadata={"format": "pt"}, durable=False)


def write_offload_file(
    offload_dir: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    *,
    name: str = OFFLOAD_FILE,
) -> MappedFile:
    """Write ``tensors`` as safetensors file ``name`` in ``offload_dir`` and map it.

    The file is written under a temporary name, mapped, then renamed into place: a process
    that maps a file of the same name before or after (another rank, an earlier dispatch)
    keeps its own copy intact.

    Args:
        offload_dir: The folder (created when missing).
        tensors: The tensors, by key; device and non-contiguous ones are copied to the host
            one at a time.
        name: The file name.

    Returns:
        The mapped file.

    Raises:
        CheckpointError: a dtype safetensors cannot store.

    Example:
        >>> mapped = write_offload_file("offload", {"fc.weight": torch.ones(2, 2)})
        >>> mapped.tensor("fc.weight").sum()
        tensor(4.)
    """
    path = Path(os.path.abspath(Path(offload_dir) / name))

    def write(tmp: Path) -> MappedFile:
        _write(tmp, tensors)
        return MappedFile(path, open_path=tmp)

    return write_file_atomically(path, write)

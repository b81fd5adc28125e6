"""Offloaded weights: pickle-free files on disk, memory-mapped back on demand.

Weights placed on ``"disk"`` live in safetensors files: a checkpoint shard mapped where it is,
or a file :func:`write_offload_file` wrote into the offload folder. :class:`MappedFile` maps
a file once, privately (copy-on-write): a tensor is a view of the file's pages, so reading it
copies nothing, writing to it never reaches the file, and :meth:`MappedFile.releaser` gives
its pages back after a forward so resident memory stays at one module's weights.
"""

from __future__ import annotations

import functools
import mmap
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import torch

from accel.checkpoint._atomic import write_file_atomically
from accel.checkpoint._format import _DTYPES, _NAMES, map_safetensors, write_safetensors
from accel.errors import CheckpointError

__all__ = ["MappedFile", "TensorSource", "map_sources", "write_offload_file"]

OFFLOAD_FILE = "accel-offload.safetensors"
_PAGE = mmap.PAGESIZE
_RELEASE_MIN = 64 << 10  # smaller tensors keep their pages: refaulting costs more than they hold
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


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
        try:
            mapped, base, entries, _ = map_safetensors(path, open_path=open_path, bad=_bad_file)
        except OSError as exc:
            raise CheckpointError(
                f"Cannot open weights file {os.fspath(path)!r} ({exc.strerror or exc}). Check "
                "the path, or load the checkpoint again if it was moved."
            ) from None
        self._mm: mmap.mmap | None = mapped
        self._entries: dict[str, _Entry] = {
            key: _Entry(
                _NAMES[info["dtype"]],
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
                view = torch.empty(entry.shape, dtype=entry.dtype)
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
        if tensor.dtype not in _DTYPES:
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

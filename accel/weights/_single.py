"""One object in one file, as ``accel.save`` writes it and ``accel.load`` reads it.

The format follows the file name: ``*.safetensors`` holds a flat dict of tensors; any other
name holds torch's format (``torch.save``), checked right after writing to be readable by
plain ``torch.load(path)`` with its default ``weights_only=True``. Reading looks at the
content, not the name: a safetensors file starts with the 8-byte little-endian length of a
JSON header that opens with ``{``; a torch file is a zip archive (``PK``) or, in torch's old
format, a pickle (``0x80``). Torch files are read with ``weights_only=True`` only, so a file
holding code (a pickle with a malicious ``__reduce__``) is refused before anything runs; a
torch zip is first checked by :mod:`accel._files.torch_zip` (no compressed member, every
storage of its declared size), so a zip bomb is refused before anything is inflated.
"""

from __future__ import annotations

import collections
import os
import pickle
import struct
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from accel._files.format import NAMED_DTYPES, map_safetensors, write_safetensors
from accel._files.safe_io import open_regular, pread_into
from accel._files.torch_zip import opened_torch_file
from accel.errors import CheckpointArgumentError, CheckpointError, ConfigError

__all__ = ["check_flat_tensors", "read_file", "wants_safetensors", "write_torch"]

SUFFIX = ".safetensors"
_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
          torch.Size)


def wants_safetensors(path: Path, safe_serialization: object) -> bool:
    """Whether ``accel.save`` writes safetensors to ``path``: the name decides unless told.

    Raises:
        CheckpointArgumentError: ``safe_serialization`` is not ``True``, ``False`` or ``None``.
        CheckpointError: ``safe_serialization=False`` with a ``.safetensors`` name.
    """
    named = path.name.lower().endswith(SUFFIX)
    if safe_serialization is None:
        return named
    if not isinstance(safe_serialization, bool):
        raise CheckpointArgumentError(
            f"accel.save(safe_serialization={safe_serialization!r}): give True (safetensors), "
            "False (torch's format) or leave it out to choose by the file name "
            f"(`{SUFFIX}` -> safetensors, any other name -> torch's format)."
        )
    if named and not safe_serialization:
        raise CheckpointError(
            f"accel.save(..., {os.fspath(path)!r}, safe_serialization=False) would write "
            f"torch's format under a {SUFFIX} name, which neither safetensors nor "
            "`torch.load` (it reads such names as safetensors) can read. Drop "
            "safe_serialization=False to write safetensors, or use a name such as 'state.pt'."
        )
    return safe_serialization


def check_flat_tensors(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    """``obj`` as a flat ``{str: tensor}`` dict, or an error naming what is not.

    Raises:
        CheckpointError: ``obj`` is not a mapping, or has a key that is not a string, a value
            that is not a tensor, or a tensor on the ``meta`` device.
    """
    where = os.fspath(path)
    fix = (
        "Save a state dict (`model.state_dict()`), or use a name that does not end in "
        f"{SUFFIX} (e.g. 'state.pt') for torch's format, which holds nested objects."
    )
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"accel.save(..., {where!r}) writes safetensors, a flat dict of str -> tensor, but "
            f"got an object of type {type(obj).__name__}. {fix}"
        )
    for key, value in obj.items():
        if not isinstance(key, str):
            raise CheckpointError(
                f"accel.save(..., {where!r}) writes safetensors, whose keys are strings, but "
                f"the key {key!r} is of type {type(key).__name__}. {fix}"
            )
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"accel.save(..., {where!r}) writes safetensors, which holds only tensors, but "
                f"the value under {key!r} is of type {type(value).__name__}. {fix}"
            )
        if value.device.type == "meta":
            raise CheckpointError(
                f"accel.save(..., {where!r}): the tensor under {key!r} is on the meta device "
                "and has no data to write. Load or materialise the weights first."
            )
    return dict(obj)


def _first_unusual(obj: Any, where: str = "", depth: int = 0) -> tuple[str, type] | None:
    """The path and type of the first value that is not a tensor, number, string or
    container of them (what ``weights_only=True`` loads without help), or ``None``."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN or depth > 50:
        return None
    if isinstance(obj, Mapping):
        if type(obj) not in (dict, collections.OrderedDict):
            return where or "the object", type(obj)
        for key, value in obj.items():
            found = _first_unusual(value, f"{where}.{key}" if where else str(key), depth + 1)
            if found is not None:
                return found
        return None
    if type(obj) in (list, tuple, set):
        for i, value in enumerate(obj):
            found = _first_unusual(value, f"{where}[{i}]", depth + 1)
            if found is not None:
                return found
        return None
    return where or "the object", type(obj)


_TORCH_ADVICE = ("Weights only load failed", "Check the documentation", "Please file an issue",
                 "(1)", "(2)")


def _torch_reason(exc: BaseException) -> str:
    """The part of torch's error that says what is wrong, up to its first full stop."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        _, marker, rest = line.partition("WeightsUnpickler error:")
        if marker and rest.strip():
            return rest.strip().split(". ")[0].rstrip(".")
    for line in lines:
        if not line.startswith(_TORCH_ADVICE):
            return line.split(". ")[0].rstrip(".")
    return lines[0] if lines else type(exc).__name__


def _refused_at_save(obj: Any, path: Path, what: str) -> CheckpointError:
    found = _first_unusual(obj)
    culprit = (
        f" (the value at {found[0]!r} is of type {found[1].__module__}.{found[1].__qualname__})"
        if found is not None else ""
    )
    return CheckpointError(
        f"accel.save(..., {os.fspath(path)!r}) writes torch's format, and {what}{culprit}. "
        "Keep to tensors, numbers, strings and lists/tuples/dicts of them (e.g. a state "
        "dict): convert other values (`.tolist()`, `dataclasses.asdict(...)`), or allow the "
        "class with `torch.serialization.add_safe_globals([...])`. Nothing was written."
    )


def write_torch(tmp: Path, obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``tmp`` (fsynced), then check ``torch.load(weights_only=True)``
    reads it back (memory-mapped: the tensors' bytes are not read).

    Raises:
        CheckpointError: ``obj`` cannot be pickled, or the file needs ``weights_only=False``
            to load (it holds a class or function torch does not allow); names the first
            such value.
    """
    with open(tmp, "wb") as f:
        try:
            torch.save(obj, f)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise _refused_at_save(obj, path, f"torch.save cannot store it ({exc})") from None
        f.flush()
        os.fsync(f.fileno())
    try:
        torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        raise _refused_at_save(
            obj, path, "plain `torch.load(path)` (weights_only=True) could not read it back: "
            + _torch_reason(exc)
        ) from None


def _device(map_location: object) -> torch.device:
    try:
        if isinstance(map_location, (str, torch.device)):
            return torch.device(map_location)
    except RuntimeError:
        pass
    raise ConfigError(
        f"accel.load(map_location={map_location!r}) is not a device; give one such as "
        "'cpu', 'cuda:0' or torch.device('cuda', 0)."
    )


def _kind(path: Path) -> str:
    """``"safetensors"``, ``"torch"`` or ``"unknown"``, from the first bytes of the file."""
    fd = open_regular(path, follow_links=True)  # a FIFO would block, a device never end
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 9, 0)
    finally:
        os.close(fd)
    if len(head) == 9:
        (header_len,) = struct.unpack("<Q", head[:8])
        if 0 < header_len <= size - 8 and head[8:9] == b"{":
            return "safetensors"
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return "torch"
    return "unknown"


def _read_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the file in memory of its own (not a view of a map of the file).

    The file is opened once: its header is checked and its tensors read (``pread``) from
    that same open file, so a file swapped in meanwhile (a FIFO, another size) is not read.
    """
    fd = open_regular(path, follow_links=True)
    try:
        own = f"/proc/self/fd/{fd}"
        mapped, base, entries, _ = map_safetensors(  # checks the header; reads no data
            path, open_path=own if os.path.exists(own) else path
        )
        mapped.close()
        out: dict[str, torch.Tensor] = {}
        for name, info in entries:  # in file order, back to back (checked above)
            dtype, shape = NAMED_DTYPES[info["dtype"]], tuple(info["shape"])
            start, end = info["data_offsets"]
            raw = torch.empty(end - start, dtype=torch.uint8)
            buffer = raw.numpy().data  # a writable memoryview of the tensor's bytes
            filled = 0
            while filled < len(buffer):
                got = pread_into(fd, buffer[filled:], base + start + filled)
                if not got:
                    raise CheckpointError(
                        f"{os.fspath(path)!r} ended while reading tensor {name!r}: the file "
                        "is truncated or was cut short while being read. Write it again."
                    )
                filled += got
            tensor = raw.view(dtype).reshape(shape) if end > start else torch.empty(
                shape, dtype=dtype)
            out[name] = tensor if device.type == "cpu" else tensor.to(device)
    finally:
        os.close(fd)
    return out


def read_file(path: Path, map_location: object) -> Any:
    """What ``accel.save`` (or ``torch.save`` / safetensors) wrote at ``path``.

    Raises:
        CheckpointError: no such file, a directory, neither format, corrupted, or a torch file
            that ``weights_only=True`` refuses (it would run code or build arbitrary objects).
        ConfigError: ``map_location`` is not a device.
    """
    device = _device(map_location)
    where = os.fspath(path)
    if path.is_dir():
        raise CheckpointError(
            f"accel.load({where!r}) reads one file, but that is a directory. Use "
            "`accel.load_checkpoint_in_model(model, dir)` for save_model's folders or "
            "`accel.load_state(dir, ...)` for save_state's checkpoints."
        )
    try:
        kind = _kind(path)
    except CheckpointError as exc:  # a FIFO, a device, a socket
        raise CheckpointError(
            f"accel.load({where!r}) reads a regular file, but that is a special file: {exc}"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(
            f"accel.load({where!r}): there is no such file. Check the path (relative paths "
            f"are taken from {os.getcwd()!r})."
        ) from None
    except OSError as exc:
        raise CheckpointError(f"accel.load({where!r}) cannot read the file: {exc}.") from None
    if kind == "safetensors":
        return _read_safetensors(path, device)
    if kind == "unknown":
        raise CheckpointError(
            f"accel.load({where!r}): the file is neither safetensors nor torch's format (its "
            "first bytes are not a safetensors header, a zip archive or a pickle); it is "
            "corrupted or another kind of file. Write it again with accel.save."
        )
    try:
        # an open file, not the path: torch would read any *.safetensors name as safetensors;
        # a zip is checked first (stored members of the declared sizes: no zip bomb)
        with opened_torch_file(path) as (f, _), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # plain pickle
            return torch.load(f, map_location=device, weights_only=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"accel.load({where!r}) refused the file: torch.load(weights_only=True) cannot "
            f"read it ({_torch_reason(exc)}). accel reads torch files only when they hold "
            "tensors, numbers, strings and containers of them, so no code from a file ever "
            "runs. If you trust the file, load it yourself with torch.load(weights_only=False) "
            "and save it again with accel.save."
        ) from None
    except Exception as exc:  # torch reports damaged files with many error types
        raise CheckpointError(
            f"accel.load({where!r}): the torch file cannot be read ({type(exc).__name__}: "
            f"{_torch_reason(exc)}); it is truncated or corrupted. Write it again."
        ) from None


def write_safetensors_file(tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The tensors as a safetensors file (``{"format": "pt"}`` metadata), fsynced."""
    write_safetensors(tmp, tensors, metadata={"format": "pt"})

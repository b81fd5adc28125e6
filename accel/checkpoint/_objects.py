"""One named object of a checkpoint: ``NAME.json`` (structure) + ``NAME.safetensors``.

The JSON file holds the object's ``state_dict()`` with every tensor replaced by a reference
into the safetensors file (see :mod:`accel.checkpoint._encode`); reading checks each file's
size and CRC32 against the manifest first.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint._encode import decode, encode
from accel.checkpoint._format import FileRecord, read_safetensors
from accel.checkpoint._writer import PlannedFile, plan_bytes, plan_safetensors, write_files
from accel.errors import CheckpointError

__all__ = ["plan_object", "read_object", "write_object"]


def plan_object(
    tmp: Path, name: str, state_dict: Any, extra: dict[str, Any] | None = None
) -> list[PlannedFile]:
    """Plan ``state_dict`` as ``NAME.safetensors`` (if it holds tensors) + ``NAME.json``.

    The JSON body is encoded now (a snapshot of every non-tensor value); the tensors are
    referenced, and written from their memory by :func:`~accel.checkpoint._writer.write_files`.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = encode(state_dict, tensors)
    files = []
    if tensors:
        files.append(plan_safetensors(tmp, f"{name}.safetensors", tensors))
    body = json.dumps(
        {"has_tensors": bool(tensors), "state": structure, "extra": extra or {}}
    ).encode()
    files.append(plan_bytes(tmp, f"{name}.json", body))
    return files


def write_object(
    tmp: Path, name: str, state_dict: Any, extra: dict[str, Any] | None = None
) -> list[FileRecord]:
    """Write ``state_dict`` as ``NAME.safetensors`` (if it holds tensors) + ``NAME.json``."""
    return write_files(plan_object(tmp, name, state_dict, extra))


def read_object(
    path: Path, name: str, files: dict[str, dict[str, Any]]
) -> tuple[Any, dict[str, Any]]:
    """The state dict and ``extra`` of object ``name``, its files checked against ``files``."""
    meta = files.get(f"{name}.json")
    if meta is None:
        raise CheckpointError(f"The checkpoint at {os.fspath(path)!r} lists no {name}.json.")
    raw = _read_checked(path / f"{name}.json", meta)
    where = os.fspath(path / f"{name}.json")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{where!r} is corrupted: {exc}") from None
    if not isinstance(body, dict) or "state" not in body:
        raise CheckpointError(f"{where!r} is corrupted: it holds no 'state'.")
    tensors: dict[str, torch.Tensor] = {}
    if body.get("has_tensors"):
        tensor_meta = files.get(f"{name}.safetensors")
        tensor_path = path / f"{name}.safetensors"
        if tensor_meta is None or not tensor_path.is_file():
            raise CheckpointError(f"Checkpoint file {os.fspath(tensor_path)!r} is missing.")
        _check_size(tensor_path, tensor_meta)
        tensors, _ = read_safetensors(tensor_path, expected_crc32=tensor_meta["crc32"])
    extra = body.get("extra")
    return decode(body["state"], tensors), extra if isinstance(extra, dict) else {}


def _check_size(file: Path, meta: dict[str, Any]) -> None:
    try:
        size = file.stat().st_size
    except OSError:
        raise CheckpointError(f"Checkpoint file {os.fspath(file)!r} is missing.") from None
    if size != meta["size"]:
        raise CheckpointError(
            f"Checkpoint file {os.fspath(file)!r} has {size} bytes, the manifest says "
            f"{meta['size']}: it is truncated or corrupted. Load an earlier checkpoint."
        )


def _read_checked(file: Path, meta: dict[str, Any]) -> bytes:
    _check_size(file, meta)
    data = file.read_bytes()
    if zlib.crc32(data) != meta["crc32"]:
        raise CheckpointError(
            f"Checkpoint file {os.fspath(file)!r} fails its CRC32 check: it is corrupted. "
            "Load an earlier checkpoint."
        )
    return data

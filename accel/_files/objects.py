"""One named object of a checkpoint: ``NAME.json`` (structure) + ``NAME.safetensors``.

The JSON file holds the object's ``state_dict()`` with every tensor replaced by a reference
into the safetensors file (see :mod:`accel._files.encode`); reading checks each file's
size and CRC32 against the manifest first.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from accel._files.encode import decode, encode
from accel._files.format import read_safetensors
from accel._files.safe_io import MAX_JSON_BYTES, MAX_JSON_DEPTH, load_json, read_declared
from accel._files.values import check_recorded, dtype_names
from accel._files.writer import PlannedFile, plan_bytes, plan_safetensors
from accel.core.strict_json import json_depth
from accel.errors import CheckpointError

__all__ = ["Entry", "plan_object", "read_checked", "read_object", "read_structure"]


@attrs.frozen
class Entry:
    """One tensor a checkpoint holds, as a reader lists it: its name, full shape and dtype.

    Example:
        >>> Entry("lm_head.weight", (64, 32), torch.float32).shape
        (64, 32)
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def plan_object(
    tmp: Path, name: str, state_dict: Any, extra: dict[str, Any] | None = None
) -> list[PlannedFile]:
    """Plan ``state_dict`` as ``NAME.safetensors`` (if it holds tensors) + ``NAME.json``.

    The JSON body is encoded now (a snapshot of every non-tensor value); the tensors are
    referenced, and written from their memory by :func:`~accel._files.writer.write_files`.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = encode(state_dict, tensors)
    files = []
    if tensors:
        files.append(plan_safetensors(tmp, f"{name}.safetensors", tensors))
    body = json.dumps({  # "dtypes": what load checks the tensor file's header against
        "has_tensors": bool(tensors), "dtypes": dtype_names(tensors), "state": structure,
        "extra": extra or {},
    }).encode()
    _check_readable(name, body)
    files.append(plan_bytes(tmp, f"{name}.json", body))
    return files


def _check_readable(name: str, body: bytes) -> None:
    """Refuse to write a structure file that loading would refuse (too large or too deep)."""
    if len(body) > MAX_JSON_BYTES:
        problem = f"is {len(body)} bytes of JSON, more than the {MAX_JSON_BYTES} accel reads"
    elif json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        problem = f"nests more than {MAX_JSON_DEPTH} levels deep"
    else:
        return
    raise CheckpointError(
        f"The state of {name!r} (its tensors aside) {problem}, so loading would refuse it; "
        "nothing was saved. Keep large data in tensors and flatten deep nesting in that "
        "object's `state_dict()`."
    )


def read_object(
    path: Path, name: str, files: dict[str, dict[str, Any]]
) -> tuple[Any, dict[str, Any]]:
    """The state dict and ``extra`` of object ``name``, its files checked against ``files``.

    Both files are opened without following links and only when regular files, read no
    further than their manifest sizes, and CRC-checked before use (see
    :mod:`accel._files.safe_io`).
    """
    body = read_structure(path, name, files)
    tensors: dict[str, torch.Tensor] = {}
    if body.get("has_tensors"):
        tensor_meta = files.get(f"{name}.safetensors")
        tensor_path = path / f"{name}.safetensors"
        if tensor_meta is None or not os.path.lexists(tensor_path):
            raise CheckpointError(f"Checkpoint file {os.fspath(tensor_path)!r} is missing.")
        tensors, _ = read_safetensors(
            tensor_path,
            expected_crc32=tensor_meta["crc32"],
            expected_size=tensor_meta["size"],
            follow_links=False,
        )
        check_recorded(os.fspath(tensor_path), tensors, body.get("dtypes"))
    extra = body.get("extra")
    return decode(body["state"], tensors), extra if isinstance(extra, dict) else {}


def read_structure(path: Path, name: str, files: Mapping[str, Any]) -> dict[str, Any]:
    """The structure file ``NAME.json`` of object ``name`` (its ``state``, ``extra``,
    ``dtypes``...), read no further than its manifest size and CRC-checked.

    Example:
        >>> read_structure(Path("ckpt"), "model", read_manifest(Path("ckpt"))["files"])["state"]
    """
    meta = files.get(f"{name}.json")
    if meta is None:
        raise CheckpointError(f"The checkpoint at {os.fspath(path)!r} lists no {name}.json.")
    where = os.fspath(path / f"{name}.json")
    body = load_json(
        read_checked(path / f"{name}.json", meta),
        lambda problem: CheckpointError(f"{where!r} is corrupted: {problem}."),
    )
    if not isinstance(body, dict) or "state" not in body:
        raise CheckpointError(f"{where!r} is corrupted: it holds no 'state'.")
    return body


def read_checked(file: Path, meta: dict[str, Any], limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a checkpoint's JSON file: its manifest size (at most ``limit``), its CRC32.

    Raises:
        CheckpointError: missing, a link or special file, over ``limit``, another size than
            the manifest's, or a CRC32 mismatch.

    Example:
        >>> files = read_manifest(Path("ckpt"))["files"]
        >>> read_checked(Path("ckpt/model.json"), files["model.json"])
        b'{"has_tensors": true, ...'
    """
    if meta["size"] > limit:
        raise CheckpointError(
            f"Checkpoint file {os.fspath(file)!r} is {meta['size']} bytes by its manifest, more "
            f"than the {limit} accel reads for a structure file: the checkpoint is corrupted "
            "or crafted. Load an earlier checkpoint."
        )
    try:
        data = read_declared(file, meta["size"])
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint file {os.fspath(file)!r} is missing.") from None
    if zlib.crc32(data) != meta["crc32"]:
        raise CheckpointError(
            f"Checkpoint file {os.fspath(file)!r} fails its CRC32 check: it is corrupted. "
            "Load an earlier checkpoint."
        )
    return data

"""``save_state`` / ``load_state``: crash-safe, pickle-free training checkpoints.

Layout of a checkpoint directory::

    checkpoint_12/
      manifest.json                # written last: files, sizes, CRC32s, step, world size
      model.safetensors            # tensors of each named object (main process)
      model.json                   # the rest of its state_dict, tensors referenced by key
      optimizer.safetensors / optimizer.json / scheduler.json ...
      rng_rank0.safetensors / rng_rank0.json ...   # every rank's RNG states

The directory is assembled under a hidden temporary name and renamed into place only after
every rank's files are written and fsynced and the manifest is written: a killed save leaves
the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from accel._state import scope, state
from accel.accumulation import _COUNTER as MODEL_COUNTER
from accel.accumulation import _SCOPE_COUNTER as SCOPE_COUNTER
from accel.checkpoint._atomic import remove_dir, replace_dir
from accel.checkpoint._encode import decode, encode
from accel.checkpoint._format import FileRecord, read_safetensors, write_bytes, write_safetensors
from accel.checkpoint.rng import get_rng_state, set_rng_state
from accel.collectives import begin, broadcast_object, gather_object
from accel.errors import CheckpointError
from accel.model import unwrap_model

__all__ = ["CheckpointInfo", "latest_checkpoint", "load_state", "save_state"]

MANIFEST = "manifest.json"
FORMAT = "accel-checkpoint"
_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = frozenset({"manifest", "rng", "grad_scaler"})
GRAD_SCALER = "grad_scaler"
GRADS = "__gradients"  # file suffix of a model's accumulated gradients


@attrs.frozen
class CheckpointInfo:
    """What :func:`load_state` loaded: where from, which step, and what it held."""

    path: Path
    step: int | None
    world_size: int
    objects: tuple[str, ...]


def _unwrap(obj: Any) -> Any:
    return unwrap_model(obj) if isinstance(obj, nn.Module) else obj


def _check_objects(objects: dict[str, Any], op: str) -> None:
    for name, obj in objects.items():
        if not _NAME.match(name) or name in _RESERVED:
            raise CheckpointError(
                f"accel.{op}() cannot use the name {name!r} for an object: names must be "
                f"identifiers other than {sorted(_RESERVED)}. Rename the keyword argument."
            )
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise CheckpointError(
                f"accel.{op}({name}=...) got a {type(obj).__name__}, which has no "
                "`state_dict()` / `load_state_dict()`. Pass models, optimizers, schedulers, "
                "prepared data loaders, or objects that implement both methods."
            )


def _accumulation_step(holder: dict[str, Any], key: str) -> int | None:
    value = holder.get(key)
    return value if isinstance(value, int) else None


def _gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _restore_gradients(module: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, param in module.named_parameters():
        grad = grads.get(name)
        if grad is None:
            param.grad = None
        elif param.grad is not None and param.grad.shape == grad.shape:
            param.grad.copy_(grad)
        else:
            param.grad = grad.to(device=param.device, dtype=param.dtype).clone()


def _write_object(
    tmp: Path, name: str, state_dict: Any, extra: dict[str, Any] | None = None
) -> list[FileRecord]:
    tensors: dict[str, torch.Tensor] = {}
    structure = encode(state_dict, tensors)
    records = []
    if tensors:
        records.append(write_safetensors(tmp / f"{name}.safetensors", tensors, root=tmp))
    body = json.dumps(
        {"has_tensors": bool(tensors), "state": structure, "extra": extra or {}}
    ).encode()
    records.append(write_bytes(tmp / f"{name}.json", body, root=tmp))
    return records


def _write_rank_files(tmp: Path, objects: dict[str, Any], rank: int) -> list[FileRecord]:
    records: list[FileRecord] = []
    for name, obj in objects.items():
        if not isinstance(obj, nn.Module):
            if rank == 0:
                records += _write_object(tmp, name, obj.state_dict())
            continue
        step = _accumulation_step(obj.__dict__, MODEL_COUNTER)  # accumulate() counts on it
        if step:  # mid-cycle: each rank's local, not yet synced, gradients are state too
            grads = _gradients(_unwrap(obj))
            if grads:
                records += _write_object(tmp, f"{name}{GRADS}_rank{rank}", grads)
        if rank == 0:
            extra = {"accumulation_step": step}
            records += _write_object(tmp, name, _unwrap(obj).state_dict(), extra)
    scope_step = _accumulation_step(scope().extras, SCOPE_COUNTER)
    records += _write_object(
        tmp, f"rng_rank{rank}", get_rng_state(), {"accumulation_step": scope_step}
    )
    return records


def _rotate(root: Path, total_limit: int, keep: Path) -> None:
    complete = sorted(
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()
    )
    excess = len(complete) - total_limit
    for _, path in complete[: max(0, excess)]:
        if path != keep:
            remove_dir(path)
    for stale in root.glob(".checkpoint_*.tmp-*"):  # left by saves killed midway
        remove_dir(stale)


def save_state(
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    total_limit: int | None = None,
    **objects: Any,
) -> Path:
    """Save every named object, each rank's RNG states and the GradScaler, crash-safely.

    Every rank must call it (it raises at once inside a rank gate such as
    ``@accel.on_main_process``). Tensors go to safetensors, everything else to JSON: loading
    never unpickles. With ``step=N`` the checkpoint is ``directory/checkpoint_N``, and once it
    is complete the oldest complete ones beyond ``total_limit`` are deleted.

    Args:
        directory: the checkpoint directory, or the root of numbered ones with ``step``.
        step: the training step; names the checkpoint and comes back from ``load_state``.
        total_limit: keep at most this many ``checkpoint_N`` directories under ``directory``.
        **objects: anything with ``state_dict()`` / ``load_state_dict()``, by name.

    Returns:
        The path of the complete checkpoint.

    Raises:
        CheckpointError: an object cannot be saved, or a rank failed to write its files.

    Example:
        >>> accel.save_state("ckpt", step=100, total_limit=3, model=model, optimizer=opt,
        ...                  scheduler=sched, train_loader=loader)
        PosixPath('ckpt/checkpoint_100')
    """
    begin("save_state")
    _check_objects(objects, "save_state")
    if total_limit is not None and (step is None or total_limit < 1):
        raise CheckpointError(
            f"total_limit={total_limit!r} needs `step=` (it rotates `checkpoint_N` "
            "directories) and must be >= 1, e.g. `save_state(root, step=i, total_limit=3, ...)`."
        )
    st = state()
    root = Path(directory)
    final = root / f"checkpoint_{step}" if step is not None else root
    scaler = scope().grad_scaler
    if scaler is not None:
        objects = {**objects, GRAD_SCALER: scaler}
    token = broadcast_object(uuid.uuid4().hex[:16] if st.is_main_process else None)
    tmp = final.with_name(f".{final.name}.tmp-{token}")
    error: str | None = None
    records: list[FileRecord] = []
    if st.is_main_process:
        tmp.mkdir(parents=True)
    broadcast_object(None)  # the directory exists before any rank writes into it
    try:
        records = _write_rank_files(tmp, objects, st.rank)
    except (OSError, CheckpointError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    reports = gather_object((st.rank, error, [attrs.astuple(r) for r in records]))
    failures = [f"rank {r}: {e}" for r, e, _ in reports if e is not None]
    if st.is_main_process and not failures:
        try:
            manifest = {
                "format": FORMAT,
                "version": 1,
                "step": step,
                "world_size": st.world_size,
                "objects": sorted(objects),
                "created": datetime.now(timezone.utc).isoformat(),
                "torch": torch.__version__,
                "accel": _accel_version(),
                "files": [
                    {"name": n, "size": s, "crc32": c, "rank": r}
                    for r, _, recs in reports
                    for n, s, c in recs
                ],
            }
            write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            replace_dir(tmp, final)
            if total_limit is not None:
                _rotate(root, total_limit, final)
        except OSError as exc:
            failures.append(f"rank 0: {type(exc).__name__}: {exc}")
    outcome = broadcast_object(failures)
    if outcome:
        if st.is_main_process:
            remove_dir(tmp)
        raise CheckpointError(
            f"save_state({os.fspath(directory)!r}) failed; the previous checkpoint is intact. "
            f"Errors: {'; '.join(outcome)}"
        )
    return final


def _accel_version() -> str:
    from accel import __version__

    return __version__


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{os.fspath(path / MANIFEST)!r} is missing or unreadable ({exc}): {path} is not "
            "a complete accel checkpoint. Pass the checkpoint root to load the newest one."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{os.fspath(path / MANIFEST)!r} is not an accel checkpoint manifest."
        )
    return manifest


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint at ``root`` (itself, or its newest ``checkpoint_N``).

    Incomplete checkpoints (killed saves) are never returned.

    Example:
        >>> accel.latest_checkpoint("ckpt")
        PosixPath('ckpt/checkpoint_300')
    """
    base = Path(root)
    if (base / MANIFEST).is_file():
        return base
    if not base.is_dir():
        return None
    numbered = sorted(
        ((int(m.group(1)), p) for p in base.iterdir() if (m := _STEP_DIR.match(p.name))),
        reverse=True,
    )
    for _, path in numbered:
        if (path / MANIFEST).is_file():
            return path
    return None


def _read_object(
    path: Path, name: str, files: dict[str, dict[str, Any]]
) -> tuple[Any, dict[str, Any]]:
    meta = files.get(f"{name}.json")
    if meta is None:
        raise CheckpointError(f"The checkpoint at {os.fspath(path)!r} lists no {name}.json.")
    raw = _read_checked(path / f"{name}.json", meta)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        where = os.fspath(path / f"{name}.json")
        raise CheckpointError(f"{where!r} is corrupted: {exc}") from None
    tensors: dict[str, torch.Tensor] = {}
    if body.get("has_tensors"):
        tensor_meta = files.get(f"{name}.safetensors")
        tensor_path = path / f"{name}.safetensors"
        if tensor_meta is None or not tensor_path.is_file():
            raise CheckpointError(f"Checkpoint file {os.fspath(tensor_path)!r} is missing.")
        _check_size(tensor_path, tensor_meta)
        tensors, _ = read_safetensors(tensor_path, expected_crc32=tensor_meta["crc32"])
    return decode(body["state"], tensors), body.get("extra", {})


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
    import zlib

    _check_size(file, meta)
    data = file.read_bytes()
    if zlib.crc32(data) != meta["crc32"]:
        raise CheckpointError(
            f"Checkpoint file {os.fspath(file)!r} fails its CRC32 check: it is corrupted. "
            "Load an earlier checkpoint."
        )
    return data


def _load_into(obj: Any, state_dict: Any) -> None:
    target = _unwrap(obj)
    if isinstance(target, nn.Module):
        target.load_state_dict(state_dict, strict=True)
    else:
        target.load_state_dict(state_dict)


def load_state(
    directory: str | os.PathLike[str], *, missing_ok: bool = False, **objects: Any
) -> CheckpointInfo | None:
    """Load the newest complete checkpoint under ``directory`` into the named objects.

    Every rank must call it. Restores each object, this rank's RNG states (same world size
    only) and the GradScaler. Files are checked against the manifest's sizes and CRC32s.

    Args:
        directory: a checkpoint, or a root holding ``checkpoint_N`` directories.
        missing_ok: return ``None`` instead of raising when there is no checkpoint.
        **objects: the objects to restore, by the names they were saved under.

    Returns:
        A :class:`CheckpointInfo`, or ``None`` with ``missing_ok`` and no checkpoint.

    Raises:
        CheckpointError: no checkpoint, a missing object, or a corrupted file.

    Example:
        >>> info = accel.load_state("ckpt", missing_ok=True, model=model, optimizer=opt)
        >>> start = info.step if info else 0
    """
    begin("load_state")
    _check_objects(objects, "load_state")
    st = state()
    path = latest_checkpoint(directory)
    error: str | None = None
    info: CheckpointInfo | None = None
    if path is None:
        if not missing_ok:
            error = (
                f"No complete checkpoint at {os.fspath(directory)!r}. Check the path, or pass "
                "`missing_ok=True` to start from scratch when there is none."
            )
    else:
        try:
            info = _load_from(path, objects, st.rank, st.world_size)
        except CheckpointError as exc:
            error = str(exc)
    errors = [e for e in gather_object(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0] if len(set(errors)) == 1 else " | ".join(errors))
    return info


def _load_from(path: Path, objects: dict[str, Any], rank: int, world_size: int) -> CheckpointInfo:
    manifest = _read_manifest(path)
    saved = list(manifest["objects"])
    missing = [name for name in objects if name not in saved]
    if missing:
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} holds {saved}, not {missing}. Pass the "
            "names the objects were saved under."
        )
    files = {f["name"]: f for f in manifest["files"]}
    scaler = scope().grad_scaler
    same_world = manifest["world_size"] == world_size
    grad_files = {name: f"{name}{GRADS}_rank{rank}" for name in objects}
    has_grads = [name for name in objects if any(f.startswith(f"{name}{GRADS}_") for f in files)]
    if has_grads and not same_world:
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} was saved in the middle of a gradient "
            f"accumulation cycle by {manifest['world_size']} processes; its per-rank gradients "
            f"cannot be split over {world_size}. Resume with {manifest['world_size']} "
            "processes, or load a checkpoint saved on a sync step."
        )
    wanted = list(objects) + [grad_files[n] for n in has_grads if f"{grad_files[n]}.json" in files]
    if scaler is not None and GRAD_SCALER in saved:
        wanted.append(GRAD_SCALER)
    if same_world:
        wanted.append(f"rng_rank{rank}")
    # Files are mapped and CRC-checked in parallel (zlib releases the GIL), then loaded.
    with ThreadPoolExecutor(max_workers=min(len(wanted), os.cpu_count() or 1) or 1) as pool:
        loaded = dict(zip(wanted, pool.map(lambda n: _read_object(path, n, files), wanted),
                          strict=True))
    for name, obj in objects.items():
        state_dict, extra = loaded[name]
        _load_into(obj, state_dict)
        if isinstance(obj, nn.Module) and extra.get("accumulation_step") is not None:
            obj.__dict__[MODEL_COUNTER] = extra["accumulation_step"]
        if isinstance(obj, nn.Module):
            grads = loaded[grad_files[name]][0] if grad_files[name] in loaded else {}
            _restore_gradients(_unwrap(obj), grads)
    if GRAD_SCALER in loaded and scaler is not None:
        scaler.load_state_dict(loaded[GRAD_SCALER][0])
    if same_world:
        rng, extra = loaded[f"rng_rank{rank}"]
        set_rng_state(rng)
        if extra.get("accumulation_step") is not None:
            scope().extras[SCOPE_COUNTER] = extra["accumulation_step"]
    else:
        warnings.warn(
            f"The checkpoint was saved by {manifest['world_size']} processes and is loaded by "
            f"{world_size}: per-rank RNG states are not restored.",
            stacklevel=3,
        )
    return CheckpointInfo(
        path=path, step=manifest["step"], world_size=manifest["world_size"], objects=tuple(saved)
    )

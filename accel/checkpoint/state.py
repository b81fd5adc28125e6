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
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from accel._state import scope, state
from accel.accumulation import _COUNTER as MODEL_COUNTER
from accel.accumulation import _SCOPE_COUNTER as SCOPE_COUNTER
from accel.checkpoint._atomic import recover, remove_dir, replace_dir, temp_sibling, writer_lock
from accel.checkpoint._encode import decode, encode
from accel.checkpoint._fit import check_fits
from accel.checkpoint._format import FileRecord, read_safetensors, write_bytes, write_safetensors
from accel.checkpoint._layout import (
    FORMAT,
    MANIFEST,
    candidates,
    check_step,
    foreign_entries,
    is_complete,
    latest_checkpoint,
    lock_path,
    read_manifest,
)
from accel.checkpoint.rng import get_rng_state, set_rng_state
from accel.collectives import begin, broadcast_object, gather_object
from accel.errors import AccelError, CheckpointError
from accel.model import unwrap_model

__all__ = ["CheckpointInfo", "latest_checkpoint", "load_state", "save_state"]

_STEP_DIR = re.compile(r"^checkpoint_(\d+)$")
_LEFTOVER = re.compile(r"^\.(checkpoint_\d+)\.(?:tmp|old|trash)-[0-9a-f]+$")
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


def _state_dict_of(name: str, obj: Any) -> Any:
    try:
        return obj.state_dict()
    except Exception as exc:
        raise CheckpointError(
            f"{name}.state_dict() raised {type(exc).__name__}: {exc}. Fix that object's "
            "`state_dict()`; nothing was saved."
        ) from exc


def _write_rank_files(tmp: Path, objects: dict[str, Any], rank: int) -> list[FileRecord]:
    records: list[FileRecord] = []
    for name, obj in objects.items():
        if not isinstance(obj, nn.Module):
            if rank == 0:
                records += _write_object(tmp, name, _state_dict_of(name, obj))
            continue
        step = _accumulation_step(obj.__dict__, MODEL_COUNTER)  # accumulate() counts on it
        if step:  # mid-cycle: each rank's local, not yet synced, gradients are state too
            grads = _gradients(_unwrap(obj))
            if grads:
                records += _write_object(tmp, f"{name}{GRADS}_rank{rank}", grads)
        if rank == 0:
            extra = {"accumulation_step": step}
            records += _write_object(tmp, name, _state_dict_of(name, _unwrap(obj)), extra)
    scope_step = _accumulation_step(scope().extras, SCOPE_COUNTER)
    records += _write_object(
        tmp, f"rng_rank{rank}", get_rng_state(), {"accumulation_step": scope_step}
    )
    return records


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, AccelError) else f"{type(exc).__name__}: {exc}"


def _recover_root(root: Path) -> None:
    """Repair or remove what killed saves left in a root of numbered checkpoints."""
    if not root.is_dir():
        return
    names = {m.group(1) for n in os.listdir(root) if (m := _LEFTOVER.match(n))}
    for name in sorted(names):
        recover(root / name, is_complete)


def _prepare_target(directory: str | os.PathLike[str], final: Path, numbered: bool) -> Path:
    """Under the writer lock: repair leftovers, refuse foreign directories, make the tmp dir."""
    root = final.parent if numbered else final
    if numbered:
        if os.path.lexists(root) and not root.is_dir():
            raise CheckpointError(
                f"save_state({os.fspath(directory)!r}, step=...) needs a directory to hold "
                "`checkpoint_N` directories, but that path is a file. Choose another path."
            )
        _recover_root(root)
    else:
        recover(final, is_complete)
    foreign = foreign_entries(final)
    if foreign:
        shown = ", ".join(repr(name) for name in foreign[:10])
        more = f" and {len(foreign) - 10} more" if len(foreign) > 10 else ""
        raise CheckpointError(
            f"save_state({os.fspath(directory)!r}) would replace {os.fspath(final)!r}, which "
            f"holds entries accel did not write: {shown}{more}. accel only replaces its own "
            "checkpoints. Save numbered checkpoints inside it with "
            f"`accel.save_state({os.fspath(directory)!r}, step=N, ...)`, or pass a new or "
            "empty directory."
        )
    tmp = temp_sibling(final)
    tmp.mkdir(parents=True)
    return tmp


def _rotate(root: Path, total_limit: int, keep: Path) -> None:
    complete = sorted(
        (int(m.group(1)), root / name)
        for name in os.listdir(root)
        if (m := _STEP_DIR.match(name)) and is_complete(root / name)
    )
    for _, path in complete[: max(0, len(complete) - total_limit)]:
        if path == keep:
            continue
        foreign = foreign_entries(path)
        if foreign:
            warnings.warn(
                f"save_state(total_limit={total_limit}) keeps {os.fspath(path)!r}: it holds "
                f"entries accel did not write ({foreign[:5]}). Move them, then delete it.",
                stacklevel=3,
            )
            continue
        remove_dir(path)


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
    is complete the oldest complete ones beyond ``total_limit`` are deleted. Without ``step``
    the checkpoint is ``directory`` itself, which must be new, empty or an accel checkpoint:
    accel never replaces a directory holding anything it did not write.

    Args:
        directory: the checkpoint directory, or the root of numbered ones with ``step``.
        step: the training step (an ``int >= 0``); names the checkpoint and comes back from
            ``load_state``.
        total_limit: keep at most this many ``checkpoint_N`` directories under ``directory``.
        **objects: anything with ``state_dict()`` / ``load_state_dict()``, by name.

    Returns:
        The path of the complete checkpoint.

    Raises:
        CheckpointError: on every rank at once, when an argument is invalid, the directory
            holds foreign entries, another writer holds its lock, or any rank failed.

    Example:
        >>> accel.save_state("ckpt", step=100, total_limit=3, model=model, optimizer=opt,
        ...                  scheduler=sched, train_loader=loader)
        PosixPath('ckpt/checkpoint_100')
    """
    begin("save_state")
    step = check_step(step)
    _check_objects(objects, "save_state")
    if total_limit is not None and (
        step is None or not isinstance(total_limit, int) or total_limit < 1
    ):
        raise CheckpointError(
            f"total_limit={total_limit!r} needs `step=` (it rotates `checkpoint_N` "
            "directories) and must be >= 1, e.g. `save_state(root, step=i, total_limit=3, ...)`."
        )
    st = state()
    root = Path(directory)
    numbered = step is not None
    final = root / f"checkpoint_{step}" if numbered else root
    scaler = scope().grad_scaler
    if scaler is not None:
        objects = {**objects, GRAD_SCALER: scaler}
    where = os.fspath(directory)
    with ExitStack() as held:
        name: str | None = None
        problem: str | None = None
        if st.is_main_process:
            try:
                held.enter_context(writer_lock(lock_path(root, numbered), repr(where)))
                name = _prepare_target(directory, final, numbered).name
            except Exception as exc:  # every rank must hear of it, not wait for a timeout
                problem = _describe(exc)
        name, problem = broadcast_object((name, problem))
        if problem is not None or name is None:
            raise CheckpointError(problem or f"save_state({where!r}) failed to start.")
        tmp = final.with_name(name)
        error: str | None = None
        records: list[FileRecord] = []
        try:
            records = _write_rank_files(tmp, objects, st.rank)
        except Exception as exc:
            error = _describe(exc)
        reports = gather_object((st.rank, error, [attrs.astuple(r) for r in records]))
        failures = [f"rank {r}: {e}" for r, e, _ in reports if e is not None]
        if st.is_main_process and not failures:
            try:
                manifest = _manifest(step, st.world_size, objects, reports)
                write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
                replace_dir(tmp, final)
            except Exception as exc:
                failures.append(f"rank 0: {_describe(exc)}")
            else:
                if total_limit is not None:
                    try:
                        _rotate(root, total_limit, final)
                    except OSError as exc:
                        warnings.warn(
                            f"save_state: {os.fspath(final)!r} is saved, but removing older "
                            f"checkpoints failed ({exc}); the next save retries.",
                            stacklevel=2,
                        )
        outcome = broadcast_object(failures)
        if outcome:
            if st.is_main_process:
                remove_dir(tmp, owner=final)
            raise CheckpointError(
                f"save_state({where!r}) failed; the previous checkpoint is intact. "
                f"Errors: {'; '.join(outcome)}"
            )
    return final


def _manifest(
    step: int | None, world_size: int, objects: dict[str, Any], reports: list[Any]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": 1,
        "step": step,
        "world_size": world_size,
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


def _accel_version() -> str:
    from accel import __version__

    return __version__


def _read_object(
    path: Path, name: str, files: dict[str, dict[str, Any]]
) -> tuple[Any, dict[str, Any]]:
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
    import zlib

    _check_size(file, meta)
    data = file.read_bytes()
    if zlib.crc32(data) != meta["crc32"]:
        raise CheckpointError(
            f"Checkpoint file {os.fspath(file)!r} fails its CRC32 check: it is corrupted. "
            "Load an earlier checkpoint."
        )
    return data


@attrs.frozen
class _Plan:
    """A checkpoint read and verified by one rank, ready to be applied."""

    info: CheckpointInfo
    loaded: dict[str, tuple[Any, dict[str, Any]]]
    grad_files: dict[str, str]
    same_world: bool
    saved_world: int


def _verify(path: Path, objects: dict[str, Any], rank: int, world_size: int) -> _Plan:
    """Read and check everything this rank needs from ``path``; change nothing."""
    manifest = read_manifest(path)
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
    # Files are mapped and CRC-checked in parallel (zlib releases the GIL).
    with ThreadPoolExecutor(max_workers=min(len(wanted), os.cpu_count() or 1) or 1) as pool:
        loaded = dict(zip(wanted, pool.map(lambda n: _read_object(path, n, files), wanted),
                          strict=True))
    for name, obj in objects.items():
        check_fits(name, _unwrap(obj), loaded[name][0])
    info = CheckpointInfo(
        path=path, step=manifest["step"], world_size=manifest["world_size"], objects=tuple(saved)
    )
    return _Plan(info, loaded, grad_files, same_world, manifest["world_size"])


def _load_into(name: str, obj: Any, state_dict: Any) -> None:
    target = _unwrap(obj)
    try:
        if isinstance(target, nn.Module):
            target.load_state_dict(state_dict, strict=True)
        else:
            target.load_state_dict(state_dict)
    except Exception as exc:
        raise CheckpointError(
            f"{name}.load_state_dict() refused the checkpoint's {name!r} "
            f"({type(exc).__name__}: {exc}). Pass the object it was saved from."
        ) from exc


def _apply(plan: _Plan, objects: dict[str, Any], world_size: int) -> None:
    loaded, rank_file = plan.loaded, f"rng_rank{state().rank}"
    for name, obj in objects.items():
        state_dict, extra = loaded[name]
        _load_into(name, obj, state_dict)
        if isinstance(obj, nn.Module) and extra.get("accumulation_step") is not None:
            obj.__dict__[MODEL_COUNTER] = extra["accumulation_step"]
        if isinstance(obj, nn.Module):
            grad_file = plan.grad_files[name]
            _restore_gradients(_unwrap(obj), loaded[grad_file][0] if grad_file in loaded else {})
    scaler = scope().grad_scaler
    if GRAD_SCALER in loaded and scaler is not None:
        scaler.load_state_dict(loaded[GRAD_SCALER][0])
    if plan.same_world:
        rng, extra = loaded[rank_file]
        set_rng_state(rng)
        if extra.get("accumulation_step") is not None:
            scope().extras[SCOPE_COUNTER] = extra["accumulation_step"]
    else:
        warnings.warn(
            f"The checkpoint was saved by {plan.saved_world} processes and is loaded by "
            f"{world_size}: per-rank RNG states are not restored.",
            stacklevel=4,
        )


def _agree(error: str | None) -> list[str]:
    """Every rank's error (``[]`` when none failed): one collective, the same on all ranks."""
    return [f"rank {r}: {e}" if state().world_size > 1 else e
            for r, e in enumerate(gather_object(error)) if e is not None]


def load_state(
    directory: str | os.PathLike[str], *, missing_ok: bool = False, **objects: Any
) -> CheckpointInfo | None:
    """Load the newest checkpoint under ``directory`` that verifies into the named objects.

    Every rank must call it. Every file is checked against the manifest (sizes, CRC32s) and
    every object against the saved state (keys, shapes, parameter groups) on every rank
    before any object changes. A root's newest checkpoint that fails these checks is skipped
    with a warning naming it and why, and the next older one is tried; a checkpoint directory
    passed explicitly never falls back. Restores each object, this rank's RNG states (same
    world size only) and the GradScaler.

    Args:
        directory: a checkpoint, or a root holding ``checkpoint_N`` directories.
        missing_ok: return ``None`` instead of raising when there is no checkpoint at all
            (checkpoints that exist but fail verification always raise).
        **objects: the objects to restore, by the names they were saved under.

    Returns:
        A :class:`CheckpointInfo`, or ``None`` with ``missing_ok`` and no checkpoint.

    Raises:
        CheckpointError: on every rank at once: no checkpoint, a missing object, a corrupted
            file, or a state that does not fit an object.

    Example:
        >>> info = accel.load_state("ckpt", missing_ok=True, model=model, optimizer=opt)
        >>> start = info.step if info else 0
    """
    begin("load_state")
    _check_objects(objects, "load_state")
    st = state()
    where = os.fspath(directory)
    found, explicit = candidates(Path(directory)) if st.is_main_process else ([], False)
    names, explicit = broadcast_object(([os.fspath(p) for p in found], explicit))
    if not names:
        if missing_ok:
            return None
        raise CheckpointError(
            f"No complete checkpoint at {where!r}. Check the path, or pass "
            "`missing_ok=True` to start from scratch when there is none."
        )
    skipped: list[str] = []
    plan: _Plan | None = None
    for name in names:
        error: str | None = None
        try:
            plan = _verify(Path(name), objects, st.rank, st.world_size)
        except Exception as exc:  # every rank must hear of it, not wait for a timeout
            error = _describe(exc)
        errors = _agree(error)
        if not errors:
            break
        plan = None
        skipped.append(f"{name}: {' | '.join(dict.fromkeys(errors))}")
        if explicit:
            raise CheckpointError(skipped[-1])
    if plan is None:
        raise CheckpointError(
            f"No checkpoint under {where!r} can be loaded; each failed verification: "
            + "; ".join(skipped)
        )
    if skipped:
        warnings.warn(
            f"load_state({where!r}) skipped checkpoints that failed verification "
            f"({'; '.join(skipped)}) and loaded the older {os.fspath(plan.info.path)!r} instead.",
            stacklevel=2,
        )
    error = None
    try:
        _apply(plan, objects, st.world_size)
    except Exception as exc:
        error = _describe(exc)
    errors = _agree(error)
    if errors:
        raise CheckpointError(
            f"load_state({where!r}) failed while restoring {os.fspath(plan.info.path)!r}: "
            f"{' | '.join(dict.fromkeys(errors))}"
        )
    return plan.info

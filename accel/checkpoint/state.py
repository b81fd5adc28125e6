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

With ``on_each_node=True`` (machines without a shared filesystem) each machine's local main
process takes that role for its machine: it holds the lock, writes the objects, the manifest
(listing the files of its machine's ranks) and renames and rotates its own copy; every rank
writes its RNG files into its machine's copy. ``load_state`` then reads each machine's copy
and uses only checkpoints that every machine holds, from one save (the manifests' save id).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from accel._files import nodes as _nodes
from accel._files.format import FileRecord
from accel._files.objects import read_object
from accel._files.paths import as_path
from accel._files.values import check_counter, check_gradients, check_rng, check_values
from accel._files.writer import PlannedFile, write_files
from accel.checkpoint import _saving
from accel.checkpoint._agreement import call_of, settle
from accel.checkpoint._async import finish_pending, launch
from accel.checkpoint._fit import check_fits
from accel.checkpoint._loading import CheckpointInfo, agree_on_copy, load_into
from accel.checkpoint._saving import GRADS, unwrap
from accel.checkpoint._screening import listed, missing_objects, screen
from accel.checkpoint.layout import (
    candidates,
    check_step,
    latest_checkpoint,
    read_manifest,
)
from accel.checkpoint.rng import get_rng_state, set_rng_state
from accel.checkpoint.sharded.pieces import check_layout
from accel.checkpoint.sharded.reshard import resolve
from accel.comm.collectives import begin, gather_object
from accel.comm.failures import agree_on_failure, describe
from accel.core.scope import scope
from accel.core.settings import cpu_count, did_you_mean
from accel.core.state import has_active_state, state
from accel.errors import AccelError, CheckpointArgumentError, CheckpointError
from accel.parallel.engines.registry import engine_for
from accel.training.accumulation import set_accumulation_step

__all__ = ["latest_checkpoint", "load_state", "save_state"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = frozenset({"manifest", "rng", "grad_scaler"})
GRAD_SCALER = "grad_scaler"


_OPTIONS = {
    "save_state": ("step", "total_limit", "async_save", "on_each_node"),
    "load_state": ("missing_ok", "on_each_node"),
}


def _check_objects(objects: dict[str, Any], op: str) -> None:
    for name, obj in objects.items():
        if not _NAME.match(name) or name in _RESERVED:
            raise CheckpointError(
                f"accel.{op}() cannot use the name {name!r} for an object: names must be "
                f"identifiers other than {sorted(_RESERVED)}. Rename the keyword argument."
            )
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            options = _OPTIONS[op]
            hint = did_you_mean(name, options)
            if hint:  # a misspelt option, not an object
                raise CheckpointArgumentError(
                    f"accel.{op}() got an unknown option {name}={obj!r:.60}{hint}. Its options "
                    f"are {list(options)}; every other keyword names an object to "
                    f"{'save' if op == 'save_state' else 'restore'}."
                )
            raise CheckpointError(
                f"accel.{op}({name}=...) got {type(obj).__name__} {obj!r:.60}, which has no "
                "`state_dict()` / `load_state_dict()`. Pass models, optimizers, schedulers, "
                "prepared data loaders, or objects that implement both methods."
            )


def _require_objects(objects: dict[str, Any], op: str, where: str | os.PathLike[str]) -> None:
    """Refuse a call naming no object: it would save (or restore) only RNG states.

    Depends only on the arguments, so every rank raises alike, before any collective.
    """
    as_path(where, f"accel.{op}", "directory")
    if objects:
        return
    names = "model=model, optimizer=optimizer, scheduler=scheduler, train_loader=loader"
    if op == "save_state":
        fix = f"name each one: `accel.save_state(dir, {names})`"
        effect = "save only RNG states"
    else:
        fix = (f"pass the objects by the names they were saved under: `accel.save_state(dir, "
               f"{names})` is restored by `accel.load_state(dir, {names})`")
        effect = "restore nothing"
    raise CheckpointArgumentError(
        f"accel.{op}({os.fspath(where)!r}) got no objects and would {effect}: accel does not "
        f"track prepared objects, so {fix}."
    )


def _restore_gradients(module: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, param in module.named_parameters():
        grad = grads.get(name)
        if grad is None:
            param.grad = None
        elif param.grad is not None and param.grad.shape == grad.shape:
            param.grad.copy_(grad)
        else:
            param.grad = grad.to(device=param.device, dtype=param.dtype).clone()


def _shown(normalise: Callable[[Any], Any], value: Any) -> Any:
    """``value`` as ``normalise`` reads it (``5`` for ``numpy.int64(5)``), else as given."""
    try:
        return normalise(value)
    except AccelError:
        return value


def _check_save_arguments(
    directory: str | os.PathLike[str], step: object, total_limit: object, async_save: object,
    on_each_node: object, objects: dict[str, Any],
) -> tuple[int | None, bool]:
    """The step and ``on_each_node`` of a valid ``save_state`` call; raise for an invalid one.

    Depends only on the arguments (and the models' sharding), so ranks that passed the same
    arguments raise alike.
    """
    _require_objects(objects, "save_state", directory)
    checked = check_step(step)
    _check_objects(objects, "save_state")
    if total_limit is not None and (
        checked is None or isinstance(total_limit, bool) or not isinstance(total_limit, int)
        or total_limit < 1
    ):
        raise CheckpointError(
            f"total_limit={total_limit!r} needs `step=` (it rotates `checkpoint_N` "
            "directories) and must be >= 1, e.g. `save_state(root, step=i, total_limit=3, ...)`."
        )
    if not isinstance(async_save, bool) or (async_save and not has_active_state()):
        raise CheckpointArgumentError(
            f"save_state(async_save={async_save!r}) takes True or False, and True needs a "
            "`with accel.distributed():` block (its end waits for the background write). "
            "Save inside the block, or call `save_state(..., async_save=False)`."
        )
    each = _nodes.resolve(on_each_node, "save_state")
    check_layout(objects, each, "save_state")  # FSDP shards need one shared copy
    return checked, each


def save_state(
    directory: str | os.PathLike[str],
    *,
    step: int | None = None,
    total_limit: int | None = None,
    async_save: bool = False,
    on_each_node: bool | None = None,
    **objects: Any,
) -> Path:
    """Save every named object, each rank's RNG states and the GradScaler, crash-safely.

    Every rank must call it (it raises at once inside a rank gate such as
    ``@accel.on_main_process``). Tensors go to safetensors, everything else to JSON: loading
    never unpickles. With ``step=N`` the checkpoint is ``directory/checkpoint_N``, and once it
    is complete the oldest complete ones beyond ``total_limit`` are deleted. Without ``step``
    the checkpoint is ``directory`` itself, which must be new, empty or an accel checkpoint:
    accel never replaces a directory holding anything it did not write.

    With ``async_save=True`` it returns once every rank has copied its tensors into a staging
    buffer (reused by the next save); the files are written by a background thread, and the
    checkpoint is finished (manifest, rename, rotation) and its errors raised by the next
    ``save_state``, ``load_state``, :func:`accel.wait_for_checkpoints` or the end of the
    ``distributed()`` block, on every rank. Any call first finishes the previous such save.

    Args:
        directory: the checkpoint directory, or the root of numbered ones with ``step``.
        step: the training step (an ``int >= 0``); names the checkpoint and comes back from
            ``load_state``.
        total_limit: keep at most this many ``checkpoint_N`` directories under ``directory``.
        async_save: snapshot now and write in the background (needs a ``distributed()``
            block, whose end waits for the write).
        on_each_node: each machine's local main process writes a copy on its own disk (for
            machines without a shared filesystem), holding the objects and its machine's
            ranks' RNG files; default ``accel.state().on_each_node`` (False: rank 0 writes one
            copy that every rank can reach).
        **objects: anything with ``state_dict()`` / ``load_state_dict()``, by name; at least
            one (accel does not track prepared objects).

    Returns:
        The path of the complete checkpoint.

    Raises:
        CheckpointArgumentError: no object was named (it would save only RNG states).
        CheckpointError: on every rank at once, when an argument is invalid, the ranks passed
            different arguments (directory, step, object names and kinds, options: each rank's
            values are named, nothing is written), the directory holds foreign entries,
            another writer holds its lock, or any rank failed.

    Example:
        >>> accel.save_state("ckpt", step=100, total_limit=3, model=model, optimizer=opt,
        ...                  scheduler=sched, train_loader=loader)
        PosixPath('ckpt/checkpoint_100')
    """
    begin("save_state", arrive="arrival_timeout")  # named in time if some ranks never come
    st = state()
    scaler = scope().grad_scaler
    own: AccelError | None = None
    try:  # arguments only: every rank that passed the same ones meets the same error
        checked_step, each = _check_save_arguments(
            directory, step, total_limit, async_save, on_each_node, objects
        )
    except AccelError as exc:
        if st.world_size == 1:
            raise
        own, checked_step, each = exc, None, st.on_each_node  # told to every rank in start()
    call = call_of(directory, objects, {
        "step": _shown(check_step, step), "total_limit": total_limit, "async_save": async_save,
        "on_each_node": _shown(lambda v: _nodes.resolve(v, "save_state"), on_each_node),
        "grad_scaler": scaler is not None,
    }, own, machine=st.node_rank if each else None)
    finish_pending()  # an earlier asynchronous save completes (or fails) first
    if scaler is not None and own is None:
        objects = {**objects, GRAD_SCALER: scaler}
    job = _saving.start(directory, checked_step, total_limit, each, list(objects), call, own)

    def plan() -> list[PlannedFile]:
        saved = objects
        if own is None:  # the engine's state as one plain process's (collectives: every rank)
            saved = engine_for(st.strategy).checkpoint_objects(objects, gather=True)
        return _saving.plan_rank_files(job.tmp, saved, st.rank, job.writer, get_rng_state())

    if async_save:
        launch(job, plan)
        return job.final
    error: str | None = None
    records: list[FileRecord] = []
    try:
        records = write_files(plan())
    except Exception as exc:
        error = describe(exc)
    _saving.finish(job, records, error)
    return job.final


@attrs.frozen
class _Plan:
    """A checkpoint read and verified by one rank, ready to be applied."""

    info: CheckpointInfo
    loaded: dict[str, tuple[Any, dict[str, Any]]]
    grad_files: dict[str, str]
    restore_rng: bool
    rng_warning: str
    save_id: str | None


def _verify(path: Path, objects: dict[str, Any], rank: int, world_size: int) -> _Plan:
    """Read and check everything this rank needs from ``path``; change nothing."""
    manifest = read_manifest(path)
    saved = list(manifest["objects"])
    missing = missing_objects(path, saved, objects)
    if missing is not None:
        raise missing
    files = {f["name"]: f for f in manifest["files"]}
    scaler = scope().grad_scaler
    saved_world = manifest["world_size"]
    same_world = saved_world == world_size
    held = manifest.get("ranks")  # whose per-rank files this copy holds (on_each_node)
    own = same_world and (held is None or rank in held)
    grad_files = {name: f"{name}{GRADS}_rank{rank}" for name in objects}
    has_grads = [name for name in objects if any(f.startswith(f"{name}{GRADS}_") for f in files)]
    if has_grads and not same_world:
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} was saved in the middle of a gradient "
            f"accumulation cycle by {saved_world} processes; its per-rank gradients "
            f"cannot be split over {world_size}. Resume with {saved_world} "
            "processes, or load a checkpoint saved on a sync step."
        )
    if has_grads and not own:
        raise CheckpointError(
            f"The checkpoint at {os.fspath(path)!r} was saved in the middle of a gradient "
            f"accumulation cycle with on_each_node=True, and this machine's copy holds the "
            f"per-rank gradients of ranks {held}, not of rank {rank}. Resume with the same "
            "ranks on each machine, or load a checkpoint saved on a sync step."
        )
    wanted = list(objects) + [grad_files[n] for n in has_grads if f"{grad_files[n]}.json" in files]
    if scaler is not None and GRAD_SCALER in saved:
        wanted.append(GRAD_SCALER)
    if own:
        wanted.append(f"rng_rank{rank}")
    # Files are mapped and CRC-checked in parallel (zlib releases the GIL).
    with ThreadPoolExecutor(max_workers=min(len(wanted), cpu_count()) or 1) as pool:
        loaded = dict(zip(wanted, pool.map(lambda n: read_object(path, n, files), wanted),
                          strict=True))
    resolve(path, files, objects, loaded)  # FSDP: shards <-> full tensors, for each target
    for name, obj in objects.items():  # values too: a failed load must change nothing
        target = unwrap(obj)
        check_fits(name, target, loaded[name][0])
        if isinstance(target, nn.Module):
            check_counter(name, loaded[name][1].get("accumulation_step"))
            if grad_files[name] in loaded:
                check_gradients(name, grad_files[name], target, loaded[grad_files[name]][0])
    if GRAD_SCALER in wanted:
        check_values(GRAD_SCALER, scaler, loaded[GRAD_SCALER][0])
    if own:
        rng, rng_extra = loaded[f"rng_rank{rank}"]
        check_rng(f"rng_rank{rank}", get_rng_state(), rng)
        check_counter(f"rng_rank{rank}", rng_extra.get("accumulation_step"))
    info = CheckpointInfo(
        path=path, step=manifest["step"], world_size=manifest["world_size"], objects=tuple(saved)
    )
    rng_warning = (
        f"The checkpoint was saved by {saved_world} processes and is loaded by {world_size}: "
        "per-rank RNG states are not restored."
        if not same_world
        else f"This machine's copy of {os.fspath(path)!r} (on_each_node=True) holds the RNG "
        f"states of ranks {held}, not of rank {rank}: its RNG states are not restored."
    )
    save_id = manifest.get("save_id")
    return _Plan(info, loaded, grad_files, own, rng_warning,
                 save_id if isinstance(save_id, str) else None)


def _apply(plan: _Plan, objects: dict[str, Any], world_size: int) -> None:
    loaded, rank_file = plan.loaded, f"rng_rank{state().rank}"
    for name, obj in objects.items():
        state_dict, extra = loaded[name]
        load_into(name, obj, state_dict)
        if isinstance(obj, nn.Module) and extra.get("accumulation_step") is not None:
            set_accumulation_step(extra["accumulation_step"], obj)
        if isinstance(obj, nn.Module):
            grad_file = plan.grad_files[name]
            _restore_gradients(unwrap(obj), loaded[grad_file][0] if grad_file in loaded else {})
    scaler = scope().grad_scaler
    if GRAD_SCALER in loaded and scaler is not None:
        scaler.load_state_dict(loaded[GRAD_SCALER][0])
    if plan.restore_rng:
        rng, extra = loaded[rank_file]
        set_rng_state(rng)
        if extra.get("accumulation_step") is not None:
            set_accumulation_step(extra["accumulation_step"])
    else:
        warnings.warn(plan.rng_warning, stacklevel=4)


def load_state(
    directory: str | os.PathLike[str],
    *,
    missing_ok: bool = False,
    on_each_node: bool | None = None,
    **objects: Any,
) -> CheckpointInfo | None:
    """Load the newest checkpoint under ``directory`` that verifies into the named objects.

    Every rank must call it. Every file is checked against the manifest (sizes, CRC32s) and
    every object against the saved state (keys, shapes, parameter groups) on every rank
    before any object changes. A root's newest checkpoint that fails these checks is skipped
    with a warning naming it and why, and the next older one is tried; a checkpoint directory
    passed explicitly never falls back. Restores each object, this rank's RNG states (same
    world size only) and the GradScaler. With ``on_each_node``, each machine reads the copy
    on its own disk, and only checkpoints that every machine holds from the same save count.

    Args:
        directory: a checkpoint, or a root holding ``checkpoint_N`` directories.
        missing_ok: return ``None`` instead of raising when there is no checkpoint at all
            (checkpoints that exist but fail verification always raise).
        on_each_node: read each machine's own copy (what ``save_state(on_each_node=True)``
            wrote); default ``accel.state().on_each_node``.
        **objects: the objects to restore (at least one), by the names they were saved under.

    Returns:
        A :class:`CheckpointInfo`, or ``None`` with ``missing_ok`` and no checkpoint.

    Raises:
        CheckpointArgumentError: no object was named (nothing would be restored).
        CheckpointError: on every rank at once: the ranks passed different arguments
            (directory, object names and kinds, options), no checkpoint, a missing object, a
            corrupted file, or a state that does not fit an object (keys, shapes, dtype
            kinds, or values of another type than the live object holds).

    Example:
        >>> info = accel.load_state("ckpt", missing_ok=True, model=model, optimizer=opt)
        >>> start = info.step if info else 0
    """
    begin("load_state", arrive="arrival_timeout")  # named in time if some ranks never come
    finish_pending()  # an asynchronous save completes (or fails) before anything is read
    names, explicit = _agreed_candidates(directory, objects, missing_ok, on_each_node)
    # the engine's stand-ins (DeepSpeed's write into its engine when loaded)
    objects = engine_for(state().strategy).checkpoint_objects(objects, gather=False)
    if not names:  # perhaps written by DeepSpeed's engine.save_checkpoint
        from accel.checkpoint._from_deepspeed import load_deepspeed_state

        from_deepspeed = load_deepspeed_state(Path(directory), names, objects)  # every rank
        if from_deepspeed is not None:
            return from_deepspeed
    if not names or not explicit:  # perhaps written by HuggingFace Accelerate's save_state
        from accel.checkpoint._from_accelerate import load_accelerate_state
        from accel.checkpoint.foreign.accelerate import describe_found

        loaded = load_accelerate_state(Path(directory), names, objects)  # every rank
        if loaded is not None:
            return loaded
    where = os.fspath(directory)
    if not names:
        if missing_ok:
            return None
        raise CheckpointError(
            f"No complete checkpoint at {where!r}{describe_found(Path(directory))}. "
            "Check the path, or pass "
            "`missing_ok=True` to start from scratch when there is none."
        )
    plan = _first_verified(names, explicit, objects, where)
    with agree_on_failure(lambda errors: CheckpointError(
        f"load_state({where!r}) failed while restoring {os.fspath(plan.info.path)!r}: {errors}"
    )):
        _apply(plan, objects, state().world_size)
    return plan.info


def _load_arguments(
    directory: str | os.PathLike[str], objects: dict[str, Any], on_each_node: bool | None
) -> tuple[AccelError | None, bool]:
    """This rank's argument error (raised at once on one process) and ``on_each_node``."""
    st = state()
    try:  # arguments only: every rank that passed the same ones meets the same error
        _require_objects(objects, "load_state", directory)
        _check_objects(objects, "load_state")
        return None, _nodes.resolve(on_each_node, "load_state")
    except AccelError as exc:
        if st.world_size == 1:
            raise
        return exc, st.on_each_node  # told to every rank on the first gather


def _listed_candidates(
    directory: str | os.PathLike[str], writer: bool, own: AccelError | None
) -> tuple[list[Path], bool, AccelError | None]:
    """The checkpoints a writer finds under ``directory``, whether ``directory`` is one, and
    the error met (raised at once on one process)."""
    if not writer or own is not None:
        return [], False, own
    try:
        found, explicit = candidates(Path(directory))
    except Exception as exc:  # every rank must hear of it, not wait for a timeout
        if state().world_size == 1:
            raise
        return [], False, exc if isinstance(exc, AccelError) else CheckpointError(
            f"load_state({os.fspath(directory)!r}) could not list its checkpoints: "
            f"{describe(exc)}"
        )
    return found, explicit, None


def _agreed_candidates(
    directory: str | os.PathLike[str], objects: dict[str, Any], missing_ok: bool,
    on_each_node: bool | None,
) -> tuple[list[str], bool]:
    """The checkpoints every rank (every machine) sees, newest first, and whether they are
    explicit checkpoint directories; one collective.

    Raises:
        CheckpointError: on every rank alike: the ranks' arguments differ or failed, or no
            checkpoint is on every machine.
    """
    st = state()
    own, each = _load_arguments(directory, objects, on_each_node)
    writer, group = _nodes.writes(each), _nodes.group_of(each)
    found, explicit, own = _listed_candidates(directory, writer, own)
    call = call_of(directory, objects, {
        "missing_ok": missing_ok,
        "on_each_node": _shown(lambda v: _nodes.resolve(v, "load_state"), on_each_node),
        "grad_scaler": scope().grad_scaler is not None,
    }, own, machine=st.node_rank if each else None)
    gathered = gather_object(((group, writer, [os.fspath(p) for p in found], explicit), call))
    settle("load_state", [c for _, c in gathered], own, "nothing was loaded")
    names, explicit, partial = _nodes.agree_candidates([e for e, _ in gathered], group)
    if partial:
        where = os.fspath(directory)
        if not names:
            raise CheckpointError(
                f"No checkpoint at {where!r} is on every machine ({'; '.join(partial)}): "
                "with on_each_node=True each machine must hold its own copy. Copy the "
                "checkpoint to the machines that lack it."
            )
        warnings.warn(
            f"load_state({where!r}) skips checkpoints that not every machine holds: "
            f"{'; '.join(partial)}.",
            stacklevel=3,
        )
    return names, explicit


def _first_verified(
    names: list[str], explicit: bool, objects: dict[str, Any], where: str
) -> _Plan:
    """The newest candidate that every rank verified (older ones are tried after a warning,
    unless ``explicit``).

    Raises:
        CheckpointError: on every rank alike, when none verifies (or the explicit one fails).
    """
    st = state()
    skipped: list[str] = []
    plan: _Plan | None = None
    # candidates that cannot load are found with one collective, not one each
    screened = screen(names, list(objects), describe) if not explicit and len(names) > 1 else {}
    for index, name in enumerate(names):
        if index in screened:
            skipped.append(screened[index])
            continue
        error: str | None = None
        try:
            plan = _verify(Path(name), objects, st.rank, st.world_size)
        except Exception as exc:  # every rank must hear of it, not wait for a timeout
            error = describe(exc)
        errors = agree_on_copy(error, plan.save_id if plan is not None else None, repr(name))
        if not errors:
            break
        plan = None
        skipped.append(f"{name}: {' | '.join(dict.fromkeys(errors))}")
        if explicit:
            raise CheckpointError(skipped[-1])
    if plan is None:
        raise CheckpointError(
            f"No checkpoint under {where!r} can be loaded; each failed verification: "
            + listed(skipped)
        )
    if skipped:
        warnings.warn(
            f"load_state({where!r}) skipped checkpoints that failed verification "
            f"({listed(skipped)}) and loaded the older {os.fspath(plan.info.path)!r} instead.",
            stacklevel=3,
        )
    return plan

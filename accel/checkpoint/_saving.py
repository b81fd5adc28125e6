"""The phases of one ``save_state``: start, plan and write this rank's files, finish.

* :func:`start` (every rank, one collective): each writer takes its place's lock, repairs
  leftovers, makes the hidden temporary directory; all ranks agree on its name.
* :func:`plan_rank_files`: what this rank writes (objects on the writers, per-rank RNG and
  mid-cycle gradients on every rank), written by :func:`~accel._files.writer.write_files`
  now (synchronous save) or from a snapshot in a background thread (``async_save=True``).
* :func:`finish` (every rank, two collectives): every rank's file records and errors are
  gathered; each writer writes the manifest, swaps the directory into place and rotates; the
  outcome is agreed and a failure raised on every rank. The lock is released.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from accel._files import nodes as _nodes
from accel._files.atomic import remove_dir, replace_dir
from accel._files.format import FileRecord, write_bytes
from accel._files.objects import plan_object
from accel._files.writer import PlannedFile
from accel.checkpoint import _place
from accel.checkpoint._agreement import Call, settle
from accel.checkpoint.layout import FORMAT, MANIFEST
from accel.checkpoint.sharded.pieces import plan_sharded
from accel.checkpoint.sharded.stages import plan_staged
from accel.comm.collectives import gather_object
from accel.comm.failures import describe
from accel.core.state import state
from accel.errors import AccelError, CheckpointError
from accel.training.accumulation import accumulation_step
from accel.training.model import unwrap_model
from accel.weights.ties import TIED, optimizer_names, split_ties

__all__ = ["GRADS", "SaveJob", "finish", "plan_rank_files", "start", "unwrap"]

GRADS = "__gradients"  # file suffix of a model's accumulated gradients


@attrs.define(eq=False)
class SaveJob:
    """One save between :func:`start` and :func:`finish` (it holds the writer lock)."""

    where: str
    root: Path
    final: Path
    tmp: Path
    step: int | None
    total_limit: int | None
    writer: bool
    group: int
    names: list[str]
    save_id: str
    held: ExitStack


def start(
    directory: str | os.PathLike[str],
    step: int | None,
    total_limit: int | None,
    each: bool,
    names: list[str],
    call: Call,
    own: AccelError | None = None,
) -> SaveJob:
    """Lock and prepare the place (writers), agree on the temporary directory (every rank).

    ``call`` (this rank's arguments, see :mod:`~accel.checkpoint._agreement`) rides on the
    same collective: ranks that passed different arguments, or whose arguments failed
    (``own``, this rank's argument error: then this rank prepares nothing), raise together.

    Raises:
        CheckpointError: on every rank, when the ranks' arguments differ or any writer could
            not prepare its place.
    """
    st = state()
    writer, group = _nodes.writes(each), _nodes.group_of(each)
    where = os.fspath(directory) if own is None else ""
    root = Path(where)
    numbered = step is not None
    final = root / f"checkpoint_{step}" if numbered else root
    held = ExitStack()
    with held:
        name: str | None = None
        problem: str | None = None
        if writer and own is None:
            try:
                held.enter_context(_place.lock(root, numbered, where, each))
                name = _place.prepare_target(directory, final, numbered).name
            except Exception as exc:  # every rank must hear of it, not wait for a timeout
                problem = describe(exc)
        save_id = uuid.uuid4().hex if st.is_main_process else None
        gathered = gather_object(((group, writer, name, problem, save_id), call))
        try:
            # first: a mismatch of the ranks' arguments explains anything else
            settle("save_state", [c for _, c in gathered], own, "nothing was written")
            problems, tmp_name, save_id = _nodes.settle_start([e for e, _ in gathered], group)
            if problems or tmp_name is None:
                raise CheckpointError(
                    "; ".join(problems) or f"save_state({where!r}) failed to start."
                )
        except Exception:
            if name is not None:  # this machine got ready, another did not
                remove_dir(final.with_name(name), owner=final)
            raise
        return SaveJob(
            where=where, root=root, final=final, tmp=final.with_name(tmp_name), step=step,
            total_limit=total_limit, writer=writer, group=group, names=names,
            save_id=str(save_id), held=held.pop_all(),
        )


def unwrap(obj: Any) -> Any:
    """The model inside a prepared module (``unwrap_model``); any other object as it is."""
    return unwrap_model(obj) if isinstance(obj, nn.Module) else obj


def _gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _state_dict_of(name: str, obj: Any) -> Any:
    try:
        return obj.state_dict()
    except Exception as exc:
        raise CheckpointError(
            f"{name}.state_dict() raised {type(exc).__name__}: {exc}. Fix that object's "
            "`state_dict()`; nothing was saved."
        ) from exc


def plan_rank_files(
    tmp: Path, objects: dict[str, Any], rank: int, writer: bool, rng: dict[str, Any]
) -> list[PlannedFile]:
    """The files this rank writes: the objects (writers), gradients mid-cycle, ``rng``."""
    files: list[PlannedFile] = []
    for name, obj in objects.items():
        counter = accumulation_step(obj) if isinstance(
            obj, nn.Module) else None
        sharded = plan_staged(tmp, name, obj, objects, rank, writer, counter)
        if sharded is None:
            sharded = plan_sharded(tmp, name, obj, objects, rank, writer, counter)
        if sharded is not None:  # FSDP (DTensor) state: every rank writes its own shards
            files += sharded
            continue
        if not isinstance(obj, nn.Module):
            if writer:  # an optimizer also records its parameters' names (ties, reordering)
                extra = optimizer_names(obj, objects) or None
                files += plan_object(tmp, name, _state_dict_of(name, obj), extra)
            continue
        step = accumulation_step(obj)  # accumulate() counts on it
        if step:  # mid-cycle: each rank's local, not yet synced, gradients are state too
            grads = _gradients(unwrap(obj))
            if grads:
                files += plan_object(tmp, f"{name}{GRADS}_rank{rank}", grads)
        if writer:
            module = unwrap(obj)
            weights, tied = split_ties(module, _state_dict_of(name, module))
            model_extra: dict[str, Any] = {"accumulation_step": step}
            if tied:
                model_extra[TIED] = tied
            files += plan_object(tmp, name, weights, model_extra)
    scope_step = accumulation_step()
    files += plan_object(tmp, f"rng_rank{rank}", rng, {"accumulation_step": scope_step})
    return files


def finish(job: SaveJob, records: list[FileRecord], error: str | None) -> None:
    """Gather every rank's files, write the manifest, swap into place, rotate; agree.

    Every rank must call it, with its own records and error. Releases the writer lock.

    Raises:
        CheckpointError: on every rank, when any rank failed; the temporary directory is gone.
    """
    st = state()
    with job.held:
        reports = gather_object(
            (st.rank, job.group, error, [attrs.astuple(r) for r in records])
        )
        failures = [f"rank {r}: {e}" for r, _, e, _ in reports if e is not None]
        mine: str | None = None
        placed = False
        if job.writer and not failures:
            try:
                ours = [(r, e, recs) for r, g, e, recs in reports if g == job.group]
                manifest = _manifest(job, st.world_size, ours)
                write_bytes(job.tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
                replace_dir(job.tmp, job.final)
                placed = True
            except Exception as exc:
                mine = f"rank {st.rank}: {describe(exc)}"
            else:
                if job.total_limit is not None:
                    try:
                        _place.rotate(job.root, job.total_limit, job.final)
                    except OSError as exc:
                        warnings.warn(
                            f"save_state: {os.fspath(job.final)!r} is saved, but removing older "
                            f"checkpoints failed ({exc}); the next save retries.",
                            stacklevel=4,
                        )
        ends = gather_object((mine, placed))
        outcome = failures + [m for m, _ in ends if m is not None]
        if outcome:
            if job.writer:
                remove_dir(job.tmp, owner=job.final)
            state_of = (
                "machines where it completed hold the new checkpoint, the others the previous "
                "one (load_state only loads a checkpoint all machines hold from one save)"
                if any(p for _, p in ends)
                else "the previous checkpoint is intact"
            )
            raise CheckpointError(
                f"save_state({job.where!r}) failed; {state_of}. Errors: {'; '.join(outcome)}"
            )


def _manifest(job: SaveJob, world_size: int, reports: list[Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": 1,
        "step": job.step,
        "world_size": world_size,
        "save_id": job.save_id,
        "ranks": sorted({r for r, _, _ in reports}),
        "objects": sorted(job.names),
        "created": datetime.now(UTC).isoformat(),
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

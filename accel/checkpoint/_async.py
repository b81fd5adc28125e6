"""``save_state(..., async_save=True)``: snapshot now, write in the background, finish later.

The design keeps every collective in the foreground, in the same order on every rank:

1. In ``save_state`` (every rank): the place is locked and prepared as for a synchronous save
   (one collective), then every tensor this rank saves is copied into a *staging buffer*
   (kept in the ``distributed()`` scope and reused by the next save when shapes match; on
   CUDA, pinned host memory filled on a side stream that the current stream then waits for).
   The ranks agree that every snapshot succeeded (one small collective) and the call returns.
2. A background thread (started with the caller's ``contextvars`` context) writes this rank's
   files from the staging buffers into the hidden temporary directory and fsyncs them. It
   makes no collective: a thread doing gloo/NCCL collectives concurrently with the training
   loop's would interleave with them in a different order on different ranks.
3. The next ``save_state``, ``load_state``, ``wait_for_checkpoints()`` or the end of the
   ``distributed()`` block (every rank) joins this rank's thread and runs the normal end of a
   save (collectives): records and errors are gathered, the writer writes the manifest, swaps
   the directory into place and rotates. Only then is the checkpoint visible; a background
   failure is raised there, on every rank.

A process killed at any point leaves only the hidden temporary directory (cleaned up by the
next save), so the previous checkpoint stays the latest.
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING, Any

import attrs
import torch

from accel._files.atomic import remove_dir
from accel._files.format import FileRecord
from accel._files.writer import PlannedFile, write_files
from accel.comm.collectives import begin
from accel.comm.failures import describe, rank_errors
from accel.core.scope import ScopeSlot, at_block_exit, scope

if TYPE_CHECKING:  # _saving (and the model code it needs) loads with the first save
    from accel.checkpoint._saving import SaveJob

__all__ = ["finish_pending", "launch", "wait_for_checkpoints"]

@attrs.define(eq=False)
class _Pending:
    """An asynchronous save whose files are being written by ``thread``."""

    job: SaveJob
    cancelled: threading.Event
    thread: threading.Thread | None = None
    records: list[FileRecord] = attrs.field(factory=list)
    error: str | None = None


@attrs.define(eq=False)
class _Staging:
    """Host buffers holding the last snapshot, reused by the next one when they fit."""

    buffers: dict[tuple[str, int], torch.Tensor] = attrs.field(factory=dict)
    stream: Any = None  # the CUDA side stream of the device copies


_PENDING: ScopeSlot[_Pending] = ScopeSlot("accel.checkpoint pending async save")
_STAGING: ScopeSlot[_Staging] = ScopeSlot("accel.checkpoint staging buffers")


def _buffer(staging: _Staging, key: tuple[str, int], tensor: torch.Tensor) -> torch.Tensor:
    pinned = tensor.device.type == "cuda"
    old = staging.buffers.get(key)
    if (
        old is not None
        and old.shape == tensor.shape
        and old.dtype == tensor.dtype
        and old.is_pinned() == pinned
    ):
        return old
    new = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
    staging.buffers[key] = new
    return new


def _snapshot(files: list[PlannedFile], staging: _Staging) -> Any:
    """Replace every tensor part of ``files`` by its copy in a staging buffer.

    Returns the CUDA event the background thread waits for before writing, or ``None``.
    """
    used: set[tuple[str, int]] = set()
    event: Any = None
    for file in files:
        for index, part in enumerate(file.parts):
            if not isinstance(part, torch.Tensor):
                continue
            key = (file.name, index)
            used.add(key)
            buffer = _buffer(staging, key, part.detach())
            if part.device.type == "cuda":  # pinned host memory, filled on a side stream
                if staging.stream is None:
                    staging.stream = torch.cuda.Stream(part.device)  # type: ignore[no-untyped-call]
                staging.stream.wait_stream(torch.cuda.current_stream(part.device))
                with torch.cuda.stream(staging.stream):
                    buffer.copy_(part.detach(), non_blocking=True)
                part.record_stream(staging.stream)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(staging.stream)
            else:
                buffer.copy_(part.detach())
            file.parts[index] = buffer
    if event is not None:  # the step's next kernels wait for the copies, the host does not
        torch.cuda.current_stream().wait_event(event)
    for key in set(staging.buffers) - used:
        del staging.buffers[key]
    return event


def _write(pending: _Pending, files: list[PlannedFile], event: Any) -> None:
    try:
        if event is not None:
            event.synchronize()
        pending.records = write_files(files, cancelled=pending.cancelled)
    except BaseException as exc:  # raised by the next foreground call, on every rank
        pending.error = describe(exc)


def _abandon(pending: _Pending) -> None:
    """The block ends by an exception: stop the write, remove its files, release the lock."""
    pending.cancelled.set()
    if pending.thread is not None:
        pending.thread.join()
    job = pending.job
    try:
        if job.writer:
            remove_dir(job.tmp, owner=job.final)
    except OSError:  # the next save under this lock removes leftovers
        pass
    finally:
        job.held.close()


def launch(job: SaveJob, plan: Any) -> None:
    """Snapshot this rank's files (``plan()`` lists them) and write them in the background.

    Every rank must call it after :func:`~accel.checkpoint._saving.start`. A snapshot that
    fails on any rank ends the save at once on every rank (:func:`finish` raises).
    """
    from accel.checkpoint._saving import finish

    here = scope()
    staging = _STAGING.get_or_create(_Staging, here)
    error: str | None = None
    files: list[PlannedFile] = []
    event: Any = None
    try:
        files = plan()
        event = _snapshot(files, staging)
    except Exception as exc:
        error = describe(exc)
    if rank_errors(error):
        finish(job, [], error)  # raises on every rank and removes the temporary directory
    pending = _Pending(job=job, cancelled=threading.Event())
    pending.thread = threading.Thread(
        target=contextvars.copy_context().run, args=(_write, pending, files, event),
        name="accel-checkpoint-writer", daemon=False,
    )
    _PENDING.set(pending, here)
    at_block_exit(_settle_pending, here)
    pending.thread.start()


def finish_pending() -> None:
    """Wait for this scope's asynchronous save, if any, and finish it (every rank).

    Raises:
        CheckpointError: on every rank, when any rank's background write failed.
    """
    pending = _PENDING.pop()
    if pending is None:
        return
    from accel.checkpoint._saving import finish

    if pending.thread is not None:
        pending.thread.join()
    finish(pending.job, pending.records, pending.error)


def _settle_pending(failed: bool) -> None:
    """The block's exit step: finish this scope's asynchronous save, if any.

    On a normal exit the pending save is finished (every rank; its failure is raised). When an
    exception leaves the block there is no collective (the other ranks may be gone): the
    background write is stopped, its temporary directory removed and the lock released; the
    save never becomes visible.
    """
    if not failed:
        finish_pending()
        return
    pending = _PENDING.pop()
    if pending is not None:
        _abandon(pending)


def wait_for_checkpoints() -> None:
    """Wait until the last ``save_state(..., async_save=True)`` is complete and visible.

    Every rank must call it. It joins this rank's background write, then the ranks agree: the
    manifest is written, the checkpoint renamed into place and old ones rotated. A failure of
    the background write on any rank is raised here on every rank. Without a pending
    asynchronous save it returns at once. ``save_state``, ``load_state`` and the end of the
    ``distributed()`` block do the same first.

    Raises:
        CheckpointError: on every rank, when the background write failed on any rank (the
            previous checkpoint is then still the latest).

    Example:
        >>> accel.save_state("ckpt", step=100, async_save=True, model=model, optimizer=opt)
        >>> ...  # train on while the files are written
        >>> accel.wait_for_checkpoints()  # checkpoint_100 is now complete
    """
    begin("wait_for_checkpoints")
    finish_pending()

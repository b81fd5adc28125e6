"""Collective work kept referenced until the interpreter ends.

Since torch 2.13 a C++ thread that drops the last C++ reference to a tensor Python also sees
takes the GIL (the tensor's Python object is released with it). gloo's worker threads drop their
references to a collective's work, and with it to the work's tensors, a moment after the waiting
thread has been woken: when that thread is the main one and it goes on to end the interpreter,
the worker asks for the GIL while the interpreter finalizes, and Python ends such a thread in a
way C++ turns into ``std::terminate`` ("terminate called without an active exception", SIGABRT).
A gloo barrier holds the works still in flight when it was issued, so its own late release is the
one that frees them.

The cure is to keep the last works of a group referenced from Python until the interpreter's end:
the worker's release is then never the last one, and the main thread frees them while finalizing
(where it holds the GIL).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["final_barrier", "keep_until_exit"]

# never cleared: what is in it is freed by the main thread when the interpreter finalizes
_KEPT: list[object] = []


def keep_until_exit(*objects: object) -> None:
    """Keep ``objects`` (a collective's work, its tensors) referenced until the interpreter ends.

    Example:
        >>> work = dist.all_reduce(flag, async_op=True)
        >>> keep_until_exit(work, flag)  # a failing block leaves it in flight
    """
    _KEPT.extend(objects)


def final_barrier() -> bool:
    """The default group's last barrier, its work kept referenced until the interpreter ends.

    The barrier's work holds every work of the group that a worker thread had not yet released,
    so keeping it keeps them all: no worker thread frees a tensor after this returns.

    Returns:
        False when a peer already failed (the barrier raised), True otherwise.

    Example:
        >>> final_barrier()  # every rank is here; then dist.destroy_process_group()
        True
    """
    try:
        work = dist.barrier(async_op=True)
        keep_until_exit(work)
        work.wait()
    except RuntimeError:  # a peer already failed: nothing left to synchronise with
        return False
    return True

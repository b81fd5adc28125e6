"""The one workaround for DDP reducers that outlive their process group.

torch 2.13 with gloo (raw DDP too) aborts the process now and then ("terminate called without
an active exception", SIGABRT) when a ``DistributedDataParallel`` reducer is destroyed during
interpreter finalization, after its process group is gone. Two cases reach that point:

- a wrapper still referenced when a ``distributed()`` block destroys its group:
  :func:`release_ddp_reducers` (an exit step of the block, registered by :func:`watch_reducers`
  when a wrapper is made, run at its end, clean or after an error) deletes every live
  wrapper's reducer first — the module cannot train without its group anyway;
- a wrapper dropped by the script (e.g. a local of ``main()``) sits in reference cycles, so
  only the garbage collector frees it, possibly during finalization:
  :func:`collect_garbage_at_exit` (registered once, when the first wrapper is made) collects
  before finalization.

Both are set up by :func:`watch_reducers`, called before a wrapper is made.
"""

from __future__ import annotations

import atexit
import functools
import gc

import torch

from accel.core.scope import at_block_exit, scope

__all__ = ["collect_garbage_at_exit", "release_ddp_reducers", "watch_reducers"]


def release_ddp_reducers() -> None:
    """Free the gradient reducers of live DDP modules before their group goes away.

    One scan of live objects, once per job (at the end of the ``distributed()`` block that
    created the group).

    Example:
        >>> release_ddp_reducers()  # then dist.destroy_process_group()
    """
    ddp_type = torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        if issubclass(type(obj), ddp_type):  # type(), not isinstance: no __class__ lookups
            for name in ("reducer", "logger"):
                if name in obj.__dict__:
                    delattr(obj, name)
    gc.collect()


@functools.cache
def collect_garbage_at_exit() -> None:
    """Once per process: free unreachable DDP wrappers before interpreter finalization.

    Example:
        >>> collect_garbage_at_exit()  # before making a DistributedDataParallel wrapper
    """
    atexit.register(gc.collect)


def watch_reducers() -> None:
    """Before a DDP wrapper is made: free unreachable wrappers before interpreter finalization
    (once per process), and release the live ones' reducers when the current block ends, if it
    created the process group.

    Example:
        >>> watch_reducers()  # then DistributedDataParallel(module)
    """
    collect_garbage_at_exit()
    at_block_exit(_release_if_own_group)


def _release_if_own_group(failed: bool) -> None:
    if not scope().created_group:
        return
    try:
        release_ddp_reducers()
    except Exception:
        if not failed:
            raise  # after a failure, best effort: the user's exception is what matters

"""Workers never outlive their launcher: this process ends when its parent does.

``accel launch`` runs torch's elastic agent, which starts each worker in a session of its own;
a launcher killed with SIGKILL (a scheduler's kill after the grace period, the out-of-memory
killer) cannot stop them, and nothing else ties them to it. :func:`die_with_parent` is called
first in every worker (``accel.launch.worker`` and ``notebook_launcher``'s), before user code:
on Linux the kernel sends the worker SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``);
elsewhere a daemon thread checks twice a second whether the parent is gone.

Only the standard library is imported, so the worker still starts as fast as ``python script.py``.

Example:
    >>> die_with_parent()   # in a worker, before the user's code
    'prctl'
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.5
_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)


def _end_now() -> None:
    os.kill(os.getpid(), _KILL)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    _end_now()


def die_with_parent() -> str:
    """End this process (SIGKILL) as soon as its parent process dies.

    Returns:
        How: ``"prctl"`` (Linux's parent-death signal), ``"watch"`` (a thread polling the
        parent) or ``"none"`` (no parent to watch: this process was adopted already).

    Example:
        >>> die_with_parent() in ("prctl", "watch")
        True
    """
    parent = os.getppid()
    if parent <= 1:
        return "none"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(_KILL), 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before the signal was armed
                    _end_now()
                return "prctl"
        except (OSError, AttributeError):
            pass  # no libc prctl: watch instead
    threading.Thread(target=_watch, args=(parent,), name="accel-parent-watch", daemon=True).start()
    return "watch"

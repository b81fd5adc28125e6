"""Imported last by the warm fork server of :mod:`accel.testing`: every public module, frozen.

The server forks the processes of ``run_distributed`` and ``run_script``. Importing this module
there loads every module behind accel's public names (a third of a second, once, instead of
in every process that uses them), then collects garbage once and moves every object alive so
far (torch, accel and what they imported) to the collector's permanent generation
(:func:`gc.freeze`). A process forked afterwards never scans those objects: a collection there
(e.g. the one ``accel.distributed()`` makes when it leaves its group) looks only at what the
process created, instead of touching, and so copying, every page inherited from the server
(~0.3 s a process).

On Linux the server also ends what each process it forks leaves behind when it ends (the
processes a script started, in a new session or not): see
:func:`accel.testing._forkserver.end_what_workers_leave`.
"""

from __future__ import annotations

import gc
import sys
from multiprocessing import forkserver

import accel
from accel.testing._forkserver import end_what_workers_leave


def _in_fork_server() -> bool:
    """Whether this import runs in the fork server's start (``forkserver.main``'s preload)."""
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
        if frame.f_code is forkserver.main.__code__:
            return True
    return False


for _name in accel.__all__:  # each lazy name imports the module behind it
    getattr(accel, _name)

if _in_fork_server():
    end_what_workers_leave()

gc.collect()
gc.freeze()

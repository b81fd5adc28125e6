"""Imported last by the warm fork server of :mod:`accel.testing`: every public module, frozen.

The server forks the processes of ``run_distributed`` and ``run_script``. Importing this module
there loads every module behind accel's public names (a third of a second, once, instead of
in every process that uses them), then collects garbage once and moves every object alive so
far (torch, accel and what they imported) to the collector's permanent generation
(:func:`gc.freeze`). A process forked afterwards never scans those objects: a collection there
(e.g. the one ``accel.distributed()`` makes when it leaves its group) looks only at what the
process created, instead of touching, and so copying, every page inherited from the server
(~0.3 s a process).
"""

from __future__ import annotations

import gc
import importlib

import accel

for _module in sorted(set(accel._LAZY.values())):
    importlib.import_module(_module)

gc.collect()
gc.freeze()

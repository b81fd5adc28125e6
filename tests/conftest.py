"""Autouse guards: a test must not leak accel state, a process group, env vars or threads.

Also: the modules named by the ``preload`` marks of the selected tests are imported once by
the warm server that forks the processes of ``run_distributed``/``run_script``
(:func:`accel.testing.preload`), instead of once in every such process; and what the session
imported is frozen out of the garbage collector's passes.
"""

from __future__ import annotations

import contextvars
import gc
import importlib.util
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from accel.big_model import init as _big_model_init
from accel.core import scope as _scope
from accel.core import state as _state
from accel.errors import ConfigError
from accel.testing import preload
from accel.trackers import _RUN as _TRACKING_RUN

# every ContextVar and ContextSlot accel owns, with the value it holds outside any accel block
_CONTEXT_VARS = {
    "accel.core.state._STATE (the process state)": (_state._STATE, None),
    "accel.core.scope._SCOPE (the distributed() scope record)": (_scope._SCOPE, None),
    "accel.core.state._GATE (the rank gate)": (_state._GATE, None),
    "accel.big_model.init._CURRENT (init_empty_weights)": (_big_model_init._CURRENT, None),
    "accel.trackers._RUN (the tracking run)": (_TRACKING_RUN, None),
}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Preload what the selected tests' worker processes import (their ``preload`` marks).

    Runs after selection (``-m``/``-k``), before any test: only the modules of tests that
    will run are preloaded (``-m "not slow"`` does not pay for transformers unless a test
    it runs needs it), and the server has not started yet. Modules not installed are left
    out (their tests skip).
    """
    wanted: dict[str, None] = {}
    for item in session.items:
        for mark in item.iter_markers("preload"):
            wanted.update(dict.fromkeys(mark.args))
    for name in wanted:
        if importlib.util.find_spec(name.partition(".")[0]) is not None:
            try:
                preload(name)
            except ConfigError:  # a submodule this version of the package lacks
                pass
    # Everything imported so far (torch, transformers, hypothesis, the test modules) lives as
    # long as the session: frozen, the garbage collector's full passes (automatic ones, and
    # accel.free_memory's) stop walking it. They took ~0.3 s each, ~20% of the unit tests.
    gc.freeze()


def _built_extensions() -> set[str]:
    """C++ extensions built under torch's default extensions root (DeepSpeed's ops...)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    found = set()
    for folder, _, files in os.walk(root):
        found.update(os.path.join(folder, f) for f in files if f.endswith(".so"))
    return found


_EXTENSIONS_AT_START: set[str] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _EXTENSIONS_AT_START.update(_built_extensions())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No test may compile a C++ extension (a DeepSpeed op built at first use takes minutes:
    CI has no time for it). Checked once, by the controlling process."""
    if hasattr(session.config, "workerinput"):
        return
    new = sorted(_built_extensions() - _EXTENSIONS_AT_START)
    if new:
        print(f"\nERROR: the tests compiled C++ extensions at run time: {new}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _environ() -> dict[str, str]:
    # pytest and torch itself (e.g. TORCHINDUCTOR_CACHE_DIR on first use) set a few variables,
    # and `import deepspeed` sets PYTORCH_NVML_BASED_CUDA_CHECK (transformers imports it lazily)
    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK")
        and not k.startswith("TORCHINDUCTOR_")
    }


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    env_before = _environ()
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    _scope.reset_detached_scope()  # what set_trigger() etc. did outside any block
    for name, (var, outside) in _CONTEXT_VARS.items():
        value = var.get(None) if isinstance(var, contextvars.ContextVar) else var.get()
        assert value is outside, f"a test left {name} set (ContextVar leak)"
    assert not (dist.is_available() and dist.is_initialized()), (
        "a test left a torch.distributed process group initialised"
    )
    assert _environ() == env_before, "a test changed os.environ without restoring it"
    # a library may shut its pool down without waiting (transformers' loader does:
    # shutdown(wait=False)); a thread that ends on its own within a moment is not a leak
    deadline = time.monotonic() + 5.0
    for t in threading.enumerate():
        if t.ident not in threads_before and not t.daemon:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    leaked = [
        t.name
        for t in threading.enumerate()
        if t.ident not in threads_before and t.is_alive() and not t.daemon
    ]
    assert not leaked, f"a test left threads running: {leaked}"

"""Autouse guards: a test must not leak accel state, a process group, env vars or threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from accel import _state
from accel.big_model import init as _big_model_init
from accel.trackers import _RUN as _TRACKING_RUN

# every ContextVar accel owns, with the value it holds outside any accel block
_CONTEXT_VARS = {
    "accel._state._STATE (the process state)": (_state._STATE, None),
    "accel._state._SCOPE (the distributed() scope record)": (_state._SCOPE, None),
    "accel._state._GATE (the rank gate)": (_state._GATE, None),
    "accel.big_model.init._CURRENT (init_empty_weights)": (_big_model_init._CURRENT, None),
    "accel.trackers._RUN (the tracking run)": (_TRACKING_RUN, None),
}


def _environ() -> dict[str, str]:
    # pytest and torch itself (e.g. TORCHINDUCTOR_CACHE_DIR on first use) set a few variables
    return {
        k: v
        for k, v in os.environ.items()
        if k != "PYTEST_CURRENT_TEST" and not k.startswith("TORCHINDUCTOR_")
    }


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    env_before = _environ()
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    _state.reset_detached_scope()  # what set_trigger() etc. did outside any block
    for name, (var, outside) in _CONTEXT_VARS.items():
        assert var.get(None) is outside, f"a test left {name} set (ContextVar leak)"
    assert not (dist.is_available() and dist.is_initialized()), (
        "a test left a torch.distributed process group initialised"
    )
    assert _environ() == env_before, "a test changed os.environ without restoring it"
    leaked = [
        t.name
        for t in threading.enumerate()
        if t.ident not in threads_before and t.is_alive() and not t.daemon
    ]
    assert not leaked, f"a test left threads running: {leaked}"

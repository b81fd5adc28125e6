"""Autouse guards: a test must not leak accel state, a process group, env vars or threads."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from accel import _state


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
    assert _state._STATE.get(None) is None, "a test left an accel state set (ContextVar leak)"
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

"""Hostile-input cases run in one child process, so that a reader that blows up its memory or
hangs fails the test instead of the test process (its code sets its own limits)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest


def run_cases(
    code: str, cases: Mapping[str, Any], *, timeout: float, env: Mapping[str, str], what: str
) -> dict[str, Any]:
    """Run ``code`` (``python -c``) with the JSON of ``cases`` as its argument; it prints one
    JSON object per finished case. Returns every case's result; fails the test when the child
    hangs past ``timeout`` seconds (naming ``what`` hung) or leaves a case without a result.
    """
    try:
        done = subprocess.run([sys.executable, "-c", code, json.dumps(cases)],
                              capture_output=True, text=True, timeout=timeout, env=dict(env),
                              check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"{what} hung the reader for {timeout}s; finished: {out}")
    results: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    assert set(results) == set(cases), (done.returncode, done.stdout, done.stderr[-3000:])
    return results

"""The active tracking run follows the context, not the ``distributed()`` block: a run started
before a block is seen inside it, and tracking blocks in different threads do not mix (also
threads that share one block's record)."""

from __future__ import annotations

import contextvars
import json
import threading
from pathlib import Path

import pytest

import accel


def _rows(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user config file (its options would reach the block)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)


def test_a_run_started_before_a_block_is_seen_inside_it(tmp_path: Path, no_config: None) -> None:
    with accel.tracking(tmp_path, run_name="outer"):
        with accel.distributed(cpu=True):
            accel.log({"inside": 1})
            with accel.tracking(tmp_path, run_name="inner"):
                accel.log({"inner": 1})
            accel.log({"inside": 2})
        accel.log({"after": 1})
    assert [row.get("inside", row.get("after")) for row in _rows(tmp_path / "outer")] == [1, 2, 1]
    assert [row["inner"] for row in _rows(tmp_path / "inner")] == [1]


@pytest.mark.parametrize("in_block", [False, True])
def test_tracking_blocks_in_two_threads_do_not_mix(
    tmp_path: Path, no_config: None, in_block: bool
) -> None:
    both_in = threading.Barrier(2, timeout=30)
    errors: list[BaseException] = []

    def track(name: str) -> None:
        try:
            with accel.tracking(tmp_path, run_name=name):
                both_in.wait()
                accel.log({"who": name})
                both_in.wait()  # neither leaves before the other has logged
        except BaseException as exc:
            errors.append(exc)

    def run_both() -> None:  # inside a block each thread runs in a copy of its context
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(track, name))
                   for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    if in_block:
        with accel.distributed(cpu=True):
            run_both()
    else:
        run_both()
    assert errors == []
    for name in ("a", "b"):
        assert [row["who"] for row in _rows(tmp_path / name)] == [name]

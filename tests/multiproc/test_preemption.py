"""``accel.stop_requested()``: every rank stops at the same call after a signal to one rank or
to all of them; no signal -> always False; handlers restored after the block; a second signal
ends the process (real processes over gloo, and one-process scripts forked from warm workers)."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch

import accel
from accel.errors import GatedCollectiveError, NotDistributedError
from accel.testing import run_distributed, run_script

STEPS = 400


def _train_until_stopped(senders: list[int], targets: str, signum: int, at: int) -> dict[str, int]:
    """A small DDP loop; at step ``at`` each rank in ``senders`` signals ``targets``.

    ``targets``: ``"self"`` (the sender signals itself) or ``"last"`` (the last rank's pid).
    Returns the step at which ``stop_requested()`` first returned True (-1: never) and how many
    times it returned True afterwards (it must keep saying True).
    """
    st = accel.state()
    pids = accel.gather_object(os.getpid())
    model = accel.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    stopped_at = -1
    for step in range(STEPS):
        if step == at and st.rank in senders:
            pid = os.getpid() if targets == "self" else pids[-1]
            os.kill(pid, signum)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.001)
        if accel.stop_requested():
            stopped_at = step
            break
    again = sum(accel.stop_requested() for _ in range(3))
    return {"stopped_at": stopped_at, "again": again}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("senders", "targets", "signum"),
    [
        ([0], "last", signal.SIGTERM),  # one rank, signalled from outside by a peer
        ([1], "self", signal.SIGUSR1),  # one rank signals itself
        ("all", "self", signal.SIGINT),  # every rank
    ],
    ids=["one-rank-sigterm", "one-rank-sigusr1", "all-ranks-sigint"],
)
def test_ranks_stop_at_the_same_step(
    world_size: int, senders: list[int] | str, targets: str, signum: int
) -> None:
    who = list(range(world_size)) if senders == "all" else senders
    out = run_distributed(_train_until_stopped, who, targets, signum, 20,
                          world_size=world_size)
    steps = {r["stopped_at"] for r in out}
    assert len(steps) == 1, out  # the same call on every rank
    (step,) = steps
    assert 20 <= step < STEPS  # seen after the signal, well before the end
    assert [r["again"] for r in out] == [3] * world_size  # and True from then on


def _never_signalled(steps: int) -> list[bool]:
    answers = []
    for _ in range(steps):
        time.sleep(0.0005)
        answers.append(accel.stop_requested())
    return answers


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_signal_always_false(world_size: int) -> None:
    out = run_distributed(_never_signalled, 300, world_size=world_size)
    assert out == [[False] * 300] * world_size


def _pending_at_the_end() -> bool:
    # starts an agreement all-reduce and leaves the block with it in flight: the block's end
    # waits for it before the group goes away
    return accel.stop_requested()


@pytest.mark.parametrize("world_size", [2, 3])
def test_block_ends_with_an_agreement_in_flight(world_size: int) -> None:
    assert run_distributed(_pending_at_the_end, world_size=world_size) == [False] * world_size


FAIL_IN_FLIGHT = """
import torch.distributed as dist
import accel
from accel.core import exit_refs

try:
    with accel.distributed():
        accel.stop_requested()  # starts the agreement's all-reduce
        raise ValueError("boom")
except ValueError:
    pass
print("kept", sum(isinstance(o, dist.Work) for o in exit_refs._KEPT))
"""


def test_a_failing_block_keeps_its_agreement_in_flight_referenced(tmp_path: Path) -> None:
    # A failing block does not wait for its agreement (a peer may never join it). The work stays
    # referenced to the interpreter's end, so gloo's worker thread finishing it late never frees
    # its tensor (which takes the GIL) while the interpreter finalizes: that aborted a raising
    # rank ("terminate called without an active exception", SIGABRT) in about one DeepSpeed
    # failure run in three, DeepSpeed keeping the group alive past the block.
    (tmp_path / "fail.py").write_text(FAIL_IN_FLIGHT)
    result = run_script("fail.py", world_size=2, cwd=tmp_path)
    assert [out.strip() for out in result.stdout] == ["kept 1", "kept 1"]


# --- one process ------------------------------------------------------------------------------

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _handlers() -> dict[int, object]:
    return {sig: signal.getsignal(sig) for sig in SIGNALS}


def _mine(signum: int, frame: object) -> None:  # a user's own handler, present before the block
    pass


def test_one_process_signal_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("stop_requested() made a collective on one process")

    monkeypatch.setattr(torch.distributed, "all_reduce", no_collective)
    with accel.distributed(cpu=True):
        assert [accel.stop_requested() for _ in range(50)] == [False] * 50
        os.kill(os.getpid(), signal.SIGUSR1)
        assert accel.stop_requested() is True
        assert accel.stop_requested() is True  # and from then on


def _fail_in_block() -> None:
    with accel.distributed(cpu=True):
        accel.stop_requested()
        raise ValueError("boom")


def test_handlers_installed_lazily_and_restored() -> None:
    previous = signal.signal(signal.SIGUSR1, _mine)
    try:
        before = _handlers()
        with accel.distributed(cpu=True):
            assert _handlers() == before  # nothing installed before the first call
            assert accel.stop_requested() is False
            assert all(signal.getsignal(s) is not before[s] for s in SIGNALS)
            with accel.distributed():  # a nested block shares the outer one's handlers
                assert accel.stop_requested() is False
            assert all(signal.getsignal(s) is not before[s] for s in SIGNALS)
        assert _handlers() == before
        with pytest.raises(ValueError, match="boom"):
            _fail_in_block()
        assert _handlers() == before  # also when an exception leaves the block
        with accel.distributed(cpu=True):
            accel.stop_requested()
            os.kill(os.getpid(), signal.SIGTERM)
            assert accel.stop_requested() is True
        with accel.distributed(cpu=True):  # a stop seen in one block does not carry over
            assert accel.stop_requested() is False
        assert _handlers() == before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_outside_main_thread_warns_and_installs_nothing() -> None:
    import contextvars
    import threading

    before = _handlers()
    with accel.distributed(cpu=True):
        answers: list[bool] = []
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(
            lambda: answers.append(accel.stop_requested()),))

        def run_thread() -> None:
            thread.start()
            thread.join()

        with pytest.warns(RuntimeWarning, match="outside the main thread"):
            run_thread()
        assert answers == [False]
        assert _handlers() == before
        assert accel.stop_requested() is False  # the main thread installs them
        assert _handlers() != before
    assert _handlers() == before


def test_outside_a_block_is_refused() -> None:
    with pytest.raises(NotDistributedError, match=r"outside a `with accel.distributed\(\):`"):
        accel.stop_requested()


def test_several_processes_without_a_group_are_refused() -> None:
    from accel.testing import fake_state

    with fake_state(rank=1, world_size=2), pytest.raises(
        NotDistributedError, match="2 processes of this job, but no process group"
    ):
        accel.stop_requested()


def test_inside_a_gate_is_refused() -> None:
    with accel.distributed(cpu=True):
        with pytest.raises(GatedCollectiveError, match="stop_requested"):
            accel.on_main_process(accel.stop_requested)()
        assert accel.stop_requested() is False


_SECOND_SIGNAL = """
import os, signal, sys, time
import accel

sig = getattr(signal, sys.argv[1])
with accel.distributed(cpu=True):
    assert accel.stop_requested() is False
    os.kill(os.getpid(), sig)
    print("first", accel.stop_requested(), flush=True)
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), sig)
    time.sleep(0.5)
    print("survived", accel.stop_requested(), flush=True)
"""


def _second_signal(tmp_path: Path, name: str, gap: float) -> tuple[int, str]:
    """`python second.py NAME GAP` without launcher variables, forked from warm workers: its
    exit code, and its stdout then stderr."""
    script = tmp_path / "second.py"
    script.write_text(textwrap.dedent(_SECOND_SIGNAL))
    env: dict[str, str | None] = {
        k: None for k in os.environ
        if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "ACCEL_"))}
    done = run_script(script, name, str(gap), world_size=1, launch=False, env=env,
                      timeout=120, check=False)
    assert not done.timed_out, done.output
    return done.exit_codes[0], done.stdout[0] + done.stderr[0]


@pytest.mark.slow
def test_second_sigterm_ends_the_process(tmp_path: Path) -> None:
    code, output = _second_signal(tmp_path, "SIGTERM", 2.3)
    assert code == -signal.SIGTERM, output
    assert "first True" in output
    assert "survived" not in output


@pytest.mark.slow
def test_second_sigint_raises_keyboard_interrupt(tmp_path: Path) -> None:
    code, output = _second_signal(tmp_path, "SIGINT", 2.3)
    assert code == -signal.SIGINT, output  # Python's exit for an uncaught one
    assert "first True" in output
    assert "KeyboardInterrupt" in output
    assert "survived" not in output


def test_a_repeat_within_two_seconds_is_the_same_request(tmp_path: Path) -> None:
    code, output = _second_signal(tmp_path, "SIGUSR1", 0.1)
    assert code == 0, output
    assert "first True" in output
    assert "survived True" in output

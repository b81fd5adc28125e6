from __future__ import annotations

import logging

import pytest
import torch

import accel
from accel.errors import GatedCollectiveError
from accel.testing import fake_state


@accel.on_main_process
def main_only(x: int) -> int:
    """Doubles x."""
    return 2 * x


@accel.on_last_process(default=-1)
def last_only() -> int:
    return 7


@accel.on_process(2)
def third() -> str:
    return "rank 2"


@accel.on_local_process(1, default="skipped")
def second_local() -> str:
    return "local 1"


@accel.on_local_main_process
def local_main() -> str:
    return "local main"


@pytest.mark.parametrize("rank", range(4))
def test_decorators_decide_at_call_time(rank: int) -> None:
    with fake_state(rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2):
        assert main_only(3) == (6 if rank == 0 else None)
        assert last_only() == (7 if rank == 3 else -1)
        assert third() == ("rank 2" if rank == 2 else None)
        assert second_local() == ("local 1" if rank % 2 == 1 else "skipped")
        assert local_main() == ("local main" if rank % 2 == 0 else None)


def test_decorators_keep_metadata() -> None:
    assert main_only.__name__ == "main_only" and main_only.__doc__ == "Doubles x."
    assert main_only.__wrapped__(1) == 2  # type: ignore[attr-defined]


def test_decorator_misuse_is_a_type_error() -> None:
    with pytest.raises(accel.errors.ArgumentTypeError, match=r"@accel\.on_process\(1\)"):
        accel.on_process(main_only)  # type: ignore[arg-type]
    with pytest.raises(accel.errors.ArgumentTypeError, match="decorates a function"):
        accel.on_main_process(3)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "collective",
    [
        lambda: accel.gather(torch.zeros(1)),
        lambda: accel.reduce(torch.zeros(1)),
        lambda: accel.gather_object(1),
        lambda: accel.broadcast(torch.zeros(1)),
        lambda: accel.broadcast_object(1),
        lambda: accel.pad_across_processes(torch.zeros(1)),
        accel.wait_for_everyone,
        accel.check_trigger,
    ],
)
def test_collective_inside_a_gate_raises_naming_both(collective: object) -> None:
    @accel.on_main_process
    def report() -> None:
        collective()  # type: ignore[operator]

    with pytest.raises(GatedCollectiveError, match="on_main_process") as info:
        report()
    assert "report" in str(info.value) and "collective" in str(info.value)
    with pytest.raises(GatedCollectiveError, match="main_process_first"):  # noqa: SIM117
        with accel.main_process_first():
            collective()  # type: ignore[operator]


def test_set_trigger_is_allowed_inside_a_gate() -> None:
    @accel.on_main_process
    def flag() -> None:
        accel.set_trigger()

    flag()
    assert accel.check_trigger() is True
    assert accel.check_trigger() is False


def test_main_process_first_single_process_runs_the_block() -> None:
    ran = []
    with accel.main_process_first():
        ran.append(1)
    with accel.local_main_process_first():
        ran.append(2)
    assert ran == [1, 2]


def test_print_once_per_machine(capsys: pytest.CaptureFixture[str]) -> None:
    for rank in range(4):
        with fake_state(rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2):
            accel.print("hello", rank)
    assert capsys.readouterr().out == "hello 0\nhello 2\n"


def test_logger_main_process_only_and_caller_location(caplog: pytest.LogCaptureFixture) -> None:
    logger = accel.get_logger("accel.test.gating", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="accel.test.gating"):
        with fake_state(rank=1, world_size=2):
            logger.info("hidden")
            logger.info("shown %d", 1, main_process_only=False)
        logger.warning("main")  # single process: rank 0
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["shown 1", "main"]
    assert all(r.filename == "test_gating.py" for r in caplog.records)
    assert all(r.funcName == "test_logger_main_process_only_and_caller_location"
               for r in caplog.records)


def test_logger_in_order_on_one_process(caplog: pytest.LogCaptureFixture) -> None:
    logger = accel.get_logger("accel.test.order", main_process_only=False)
    with caplog.at_level(logging.INFO, logger="accel.test.order"):
        logger.info("in order", in_order=True)
    assert [r.getMessage() for r in caplog.records] == ["in order"]

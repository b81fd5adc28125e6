from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import accel
from accel import memory
from accel.core import scope as _scope
from accel.core import state as _state
from accel.errors import ConfigError, NoExecutableBatchSizeError
from accel.memory import is_out_of_memory
from accel.testing import fake_state


def _oom_above(limit: int, tried: list[int], error: type[BaseException] = torch.OutOfMemoryError):
    def train(batch_size: int, scale: int = 1) -> int:
        tried.append(batch_size)
        if batch_size > limit:
            raise error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale

    return train


def test_decorator_halves_until_it_fits() -> None:
    tried: list[int] = []

    @accel.find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, scale: int) -> int:
        tried.append(batch_size)
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size * scale

    assert train(10) == 160
    assert tried == [128, 64, 32, 16]
    assert train.__name__ == "train"
    assert train(scale=1) == 16
    assert tried[-1] == 16


def test_call_form_and_default_start() -> None:
    tried: list[int] = []
    run = accel.find_executable_batch_size(_oom_above(100, tried))
    assert run() == 64
    assert tried == [128, 64]
    tried.clear()
    run = accel.find_executable_batch_size(_oom_above(100, tried), starting_batch_size=7)
    assert run(scale=2) == 14
    assert tried == [7]


@given(start=st.integers(1, 4096), limit=st.integers(1, 4096))
def test_tries_halvings_and_stops_at_the_first_that_fits(start: int, limit: int) -> None:
    tried: list[int] = []
    with pytest.MonkeyPatch.context() as patch:  # a full gc per attempt is slow in a test
        patch.setattr(memory.gc, "collect", lambda: 0)
        run = accel.find_executable_batch_size(_oom_above(limit, tried), starting_batch_size=start)
        found = run()
    expected = [start]
    while expected[-1] > limit:
        expected.append(expected[-1] // 2)
    assert tried == expected
    assert found == expected[-1] <= limit


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        MemoryError(),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"),  # noqa: E501
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes."),
        RuntimeError("HIP out of memory. Tried to allocate 2 GiB"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if..."),
    ],
)
def test_out_of_memory_errors(error: BaseException) -> None:
    assert is_out_of_memory(error)
    tried: list[int] = []

    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 8:
            raise error
        return batch_size

    assert accel.find_executable_batch_size(train, starting_batch_size=32)() == 8
    assert tried == [32, 16, 8]


def test_other_errors_propagate_at_once() -> None:
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))
    tried: list[int] = []

    @accel.find_executable_batch_size(starting_batch_size=16)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        train()
    assert tried == [16]


def test_nothing_fits() -> None:
    tried: list[int] = []
    run = accel.find_executable_batch_size(_oom_above(0, tried), starting_batch_size=5)
    with pytest.raises(NoExecutableBatchSizeError, match=r"every batch size tried \[5, 2, 1\]"):
        run()
    assert tried == [5, 2, 1]
    assert isinstance(NoExecutableBatchSizeError("x"), RuntimeError)
    with pytest.raises(RuntimeError, match=r"No executable batch size found.*is 0"):
        accel.find_executable_batch_size(_oom_above(0, tried), starting_batch_size=0)()
    assert tried == [5, 2, 1]


def test_misuse_is_a_clear_type_error() -> None:
    with pytest.raises(accel.errors.ArgumentTypeError, match="first argument, named `batch_size`"):

        @accel.find_executable_batch_size
        def train(model: Any, batch_size: int) -> None: ...

    with pytest.raises(accel.errors.ArgumentTypeError, match="batch_size"):
        accel.find_executable_batch_size(lambda: None)
    with pytest.raises(accel.errors.ArgumentTypeError, match="batch_size"):
        accel.find_executable_batch_size(lambda *, batch_size: None)

    @accel.find_executable_batch_size(starting_batch_size=8)
    def fit(batch_size: int, model: str) -> str:
        return model

    with pytest.raises(
        accel.errors.ArgumentTypeError, match=r"passes it itself.*fit\(<the other arguments>\)"
    ):
        fit(8, "m")
    with pytest.raises(accel.errors.ArgumentTypeError, match="passes it itself"):
        fit("m", batch_size=8)  # type: ignore[call-arg]
    assert fit("m") == "m"

    with pytest.raises(accel.errors.ArgumentTypeError, match="starting_batch_size=64"):
        accel.find_executable_batch_size(64)  # type: ignore[call-overload]
    with pytest.raises(ConfigError, match="starting_batch_size=-1"):
        accel.find_executable_batch_size(starting_batch_size=-1)


def test_variadic_functions_accept_any_arguments() -> None:
    @accel.find_executable_batch_size(starting_batch_size=4)
    def train(batch_size: int, *args: int) -> tuple[int, ...]:
        return (batch_size, *args)

    assert train(1, 2, 3) == (4, 1, 2, 3)


def test_inside_a_gate_each_rank_decides_alone() -> None:
    tried: list[int] = []
    run = accel.find_executable_batch_size(_oom_above(3, tried), starting_batch_size=8)
    with fake_state(rank=0, world_size=2), _state.gated("@accel.on_main_process function"):
        assert run() == 2  # no collective inside a gate, and no process group needed
    assert tried == [8, 4, 2]


def test_free_memory() -> None:
    a, b = torch.ones(4), [torch.ones(2)]
    a, b = accel.free_memory(a, b)
    assert a is None
    assert b is None
    assert accel.free_memory() == []


def test_join_on_one_process_just_runs_the_block() -> None:
    model = torch.nn.Linear(2, 2)  # not DDP: fine on one process
    ran = []
    with accel.join_uneven_inputs([model]):
        ran.append(1)
    assert ran == [1]


def test_join_overrides_even_batches_for_the_block() -> None:
    class Loader:
        even_batches = True

    loader, other = Loader(), Loader()
    with fake_state() as _:
        record = _scope.scope()
        record.active_loaders.append(loader)
        with accel.join_uneven_inputs([], even_batches=False):
            assert loader.even_batches is False
            assert record.even_batches_override is False
            with accel.join_uneven_inputs([], even_batches=True):
                assert record.even_batches_override is True
            assert record.even_batches_override is False
        assert loader.even_batches is True
        assert other.even_batches is True
        assert record.even_batches_override is None
        with accel.join_uneven_inputs([]):
            assert record.even_batches_override is None
            assert loader.even_batches is True


def test_join_refuses_to_start_in_a_gate() -> None:
    with _state.gated("@accel.on_main_process function"), pytest.raises(
        accel.errors.GatedCollectiveError, match="join_uneven_inputs"
    ), accel.join_uneven_inputs([]):
        pass

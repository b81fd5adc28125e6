"""Memory helpers: find a batch size that fits, and release memory between attempts.

:func:`find_executable_batch_size` runs a function with a batch size, halving it after every
out-of-memory error. On several processes the ranks agree after each attempt (one small
all-gather), so every rank tries the same sizes and stops at the first that fitted on all.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

import torch
import torch.distributed as dist

from accel.comm.collectives import gather
from accel.core.state import current_gate, state
from accel.errors import (
    ArgumentTypeError,
    ConfigError,
    NoExecutableBatchSizeError,
    OtherRankFailedError,
)

__all__ = [
    "find_executable_batch_size",
    "free_memory",
    "is_out_of_memory",
]

P = ParamSpec("P")
R = TypeVar("R")

_OutOfMemoryError: type[BaseException] = getattr(
    torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError
)
# Messages of out-of-memory errors raised as plain RuntimeError by some devices/allocators.
_OOM_MESSAGES = (
    " out of memory",  # CUDA, HIP, XPU, MPS
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's way of failing on too large inputs
    "DefaultCPUAllocator: can't allocate memory",  # CPU, Linux
    "DefaultCPUAllocator: not enough memory",  # CPU, Windows
    "PT_DEVMEM Allocation failed",  # HPU
)
# What each rank reports after an attempt; the highest code on any rank decides.
_FITTED, _OOM, _FAILED = 0, 1, 2


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error worth retrying with a smaller batch.

    ``torch.OutOfMemoryError`` (CUDA OOM), ``MemoryError``, and ``RuntimeError`` s whose
    message is a device or CPU allocator out-of-memory message.

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
        True
    """
    if isinstance(exc, (_OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError) and exc.args and isinstance(exc.args[0], str):
        return any(message in exc.args[0] for message in _OOM_MESSAGES)
    return False


def free_memory(*objects: Any) -> list[None]:
    """Drop references, run the garbage collector and empty the accelerator's cache.

    Python cannot delete the caller's variables: reassign them from the result.

    Returns:
        One ``None`` per object.

    Example:
        >>> model, optimizer = accel.free_memory(model, optimizer)
        >>> model is None
        True
    """
    released: list[None] = [None] * len(objects)
    del objects
    gc.collect()
    cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if cuda_in_use:
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        xpu.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        mps.empty_cache()
    return released


def _agree(code: int) -> tuple[int, list[int]]:
    """The highest code of all ranks, and the ranks that reported it (this rank alone when
    not distributed, inside a rank gate, or without a process group)."""
    st = state()
    if st.world_size == 1 or current_gate() is not None or not dist.is_initialized():
        return code, [st.rank]
    codes = gather(torch.tensor([code], dtype=torch.int32, device=st.device)).tolist()
    worst = max(codes)
    return worst, [rank for rank, c in enumerate(codes) if c == worst]


def _first_parameter_check(function: Callable[..., Any]) -> int | None:
    """Raise ``TypeError`` unless ``batch_size`` is the first parameter; return how many more
    positional arguments the function takes (``None``: any number)."""
    name = getattr(function, "__qualname__", repr(function))
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust the caller
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].name != "batch_size" or parameters[0].kind not in (
        positional
    ):
        listed = ", ".join(str(p) for p in parameters)
        raise ArgumentTypeError(
            f"@accel.find_executable_batch_size passes the batch size as the first argument, "
            f"named `batch_size`, but {name}({listed}) does not take it first. Write "
            f"`def {getattr(function, '__name__', 'function')}(batch_size, ...):`."
        )
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in positional for p in parameters) - 1


def _search(
    function: Callable[..., R],
    starting_batch_size: int,
) -> Callable[..., R]:
    max_positional = _first_parameter_check(function)
    name = getattr(function, "__name__", "function")
    next_size = starting_batch_size  # the size the next call starts from (last that fitted)

    @functools.wraps(function)
    def search(*args: Any, **kwargs: Any) -> R:
        nonlocal next_size
        if "batch_size" in kwargs or (max_positional is not None and len(args) > max_positional):
            given = kwargs.get("batch_size", args[0] if args else None)
            raise ArgumentTypeError(
                f"{name}() was called with a batch size ({given!r}), but "
                "@accel.find_executable_batch_size passes it itself. Call it without: "
                f"`{name}(<the other arguments>)`."
            )
        free_memory()
        batch_size = next_size
        tried: list[int] = []
        while True:
            if batch_size < 1:
                what = (
                    f"it ran out of memory at every batch size tried {tried}"
                    if tried
                    else "starting_batch_size is 0"
                )
                raise NoExecutableBatchSizeError(
                    f"No executable batch size found for {name}(): {what}. Reduce the model "
                    "or sequence size, enable mixed precision, or start from a size that "
                    "fits: `@accel.find_executable_batch_size(starting_batch_size=...)`."
                )
            tried.append(batch_size)
            error: BaseException | None = None
            try:
                result = function(batch_size, *args, **kwargs)
                code = _FITTED
            except Exception as exc:
                if is_out_of_memory(exc):
                    code = _OOM  # the exception (and its frames' tensors) is dropped here
                else:
                    code, error = _FAILED, exc
            worst, ranks = _agree(code)
            if worst == _FITTED:
                next_size = batch_size
                return result
            if worst == _FAILED:
                if error is not None:
                    raise error
                raise OtherRankFailedError(
                    f"Rank(s) {ranks} raised an error in {name}(batch_size={batch_size}) that "
                    "is not an out-of-memory error; this rank stops too (see their traceback)."
                )
            free_memory()
            batch_size //= 2

    return search


@overload
def find_executable_batch_size(
    function: Callable[Concatenate[int, P], R], *, starting_batch_size: int = 128
) -> Callable[P, R]: ...
@overload
def find_executable_batch_size(
    function: None = None, *, starting_batch_size: int = 128
) -> Callable[[Callable[Concatenate[int, P], R]], Callable[P, R]]: ...
def find_executable_batch_size(
    function: Callable[..., Any] | None = None, *, starting_batch_size: int = 128
) -> Any:
    """Call ``function(batch_size, ...)``, halving ``batch_size`` after each out-of-memory error.

    The decorated function takes ``batch_size`` as its first parameter and is called without
    it. Out-of-memory errors are ``torch.OutOfMemoryError`` (CUDA), ``MemoryError`` and
    allocator ``RuntimeError`` s (see :func:`is_out_of_memory`); between attempts memory is
    freed (:func:`free_memory`). Later calls start from the last size that fitted.

    On several processes every rank must call it (a small collective after each attempt): a
    rank that ran out of memory makes all ranks retry at half the size, so every rank tries
    the same sequence and stops at the first size that fitted everywhere. A rank that raised
    another error re-raises it and the others raise :class:`OtherRankFailedError` instead of
    hanging. (Inside a rank-gated function each rank decides alone.) The function must not
    hang when one rank runs out of memory mid-step: with DDP, keep ``timeout`` moderate.

    Args:
        function: the function to wrap (call form); omit it to get a decorator.
        starting_batch_size: the first size tried.

    Returns:
        The wrapped function, or a decorator when ``function`` is omitted.

    Raises:
        TypeError: ``function``'s first parameter is not ``batch_size``, or the wrapped
            function is called with a batch size.
        NoExecutableBatchSizeError: even batch size 1 ran out of memory (a
            ``RuntimeError``).

    Example:
        >>> @accel.find_executable_batch_size(starting_batch_size=256)
        ... def train(batch_size, model, optimizer):
        ...     loader = DataLoader(dataset, batch_size=batch_size)
        ...     ...
        >>> train(model, optimizer)  # tries 256, 128, 64... until one fits
        >>> run = accel.find_executable_batch_size(evaluate, starting_batch_size=64)
    """
    if (
        isinstance(starting_batch_size, bool)
        or not isinstance(starting_batch_size, int)
        or starting_batch_size < 0
    ):
        raise ConfigError(
            f"starting_batch_size={starting_batch_size!r} must be a positive integer, e.g. "
            "`@accel.find_executable_batch_size(starting_batch_size=64)`."
        )
    if function is None:
        return functools.partial(_search, starting_batch_size=starting_batch_size)
    if not callable(function):
        raise ArgumentTypeError(
            f"accel.find_executable_batch_size() wraps a function, got "
            f"{type(function).__name__} {function!r:.60}. Pass the start size by keyword: "
            f"`@accel.find_executable_batch_size(starting_batch_size={function!r:.20})`."
        )
    return _search(function, starting_batch_size)

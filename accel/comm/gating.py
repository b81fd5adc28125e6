"""Rank gating: run code on some ranks only, print once, log once.

The decorators decide at call time (the state may differ between calls) and return
``default`` (``None`` unless given) on the other ranks. Code running under a gate is marked, so
a collective called there raises at once instead of hanging the job.
"""

from __future__ import annotations

import builtins
import functools
import logging
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ParamSpec, TypeVar, overload

from accel.comm.collectives import begin, gather_object, wait_for_everyone
from accel.core.state import ProcessState, gated, state
from accel.errors import ArgumentTypeError, ConfigError, MainProcessFirstError

__all__ = [
    "get_logger",
    "local_main_process_first",
    "main_process_first",
    "on_last_process",
    "on_local_main_process",
    "on_local_process",
    "on_main_process",
    "on_process",
    "print",
]

P = ParamSpec("P")
R = TypeVar("R")
D = TypeVar("D")

def _gate(
    label: str,
    predicate: Callable[[ProcessState], bool],
    function: Callable[P, R],
    default: D,
) -> Callable[P, R | D]:
    if not callable(function):
        raise ArgumentTypeError(
            f"@accel.{label} decorates a function, got {type(function).__name__} "
            f"{function!r:.60}. Use it as `@accel.{label}` above a `def`."
        )
    description = f"@accel.{label} function {getattr(function, '__qualname__', function)!r}"

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | D:
        if not predicate(state()):
            return default
        with gated(description):
            return function(*args, **kwargs)

    return wrapper


def _is_main(st: ProcessState) -> bool:
    return st.is_main_process


def _is_local_main(st: ProcessState) -> bool:
    return st.is_local_main_process


def _is_last(st: ProcessState) -> bool:
    return st.is_last_process


@overload
def on_main_process(function: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_main_process(*, default: D) -> Callable[[Callable[P, R]], Callable[P, R | D]]: ...
def on_main_process(function: Any = None, /, *, default: Any = None) -> Any:
    """Run the decorated function on global rank 0 only; other ranks get ``default``.

    Collectives inside it raise :class:`GatedCollectiveError` (they would hang).

    Example:
        >>> @accel.on_main_process
        ... def report(metrics):
        ...     print(metrics)
        >>> @accel.on_main_process(default=0)
        ... def count_files(): ...
    """
    if function is None:
        return functools.partial(_gate, "on_main_process", _is_main, default=default)
    return _gate("on_main_process", _is_main, function, default)


@overload
def on_local_main_process(function: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_local_main_process(*, default: D) -> Callable[[Callable[P, R]], Callable[P, R | D]]: ...
def on_local_main_process(function: Any = None, /, *, default: Any = None) -> Any:
    """Run the decorated function on the first process of each machine only.

    Example:
        >>> @accel.on_local_main_process
        ... def download_dataset(): ...
    """
    label = "on_local_main_process"
    if function is None:
        return functools.partial(_gate, label, _is_local_main, default=default)
    return _gate(label, _is_local_main, function, default)


@overload
def on_last_process(function: Callable[P, R], /) -> Callable[P, R | None]: ...
@overload
def on_last_process(*, default: D) -> Callable[[Callable[P, R]], Callable[P, R | D]]: ...
def on_last_process(function: Any = None, /, *, default: Any = None) -> Any:
    """Run the decorated function on the highest global rank only.

    Example:
        >>> @accel.on_last_process
        ... def check(): ...
    """
    if function is None:
        return functools.partial(_gate, "on_last_process", _is_last, default=default)
    return _gate("on_last_process", _is_last, function, default)


def _index(label: str, index: object) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ArgumentTypeError(
            f"accel.{label}() takes the process index first, got {index!r:.60}. "
            f"Write `@accel.{label}(1)` above the function."
        )
    return index


def on_process(
    index: int, *, default: D = None  # type: ignore[assignment]
) -> Callable[[Callable[P, R]], Callable[P, R | D]]:
    """Run the decorated function on global rank ``index`` only.

    Example:
        >>> @accel.on_process(1)
        ... def only_rank_one(): ...
    """
    wanted = _index("on_process", index)
    label = f"on_process({wanted})"

    def decorate(function: Callable[P, R]) -> Callable[P, R | D]:
        return _gate(label, lambda st: st.rank == wanted, function, default)

    return decorate


def on_local_process(
    index: int, *, default: D = None  # type: ignore[assignment]
) -> Callable[[Callable[P, R]], Callable[P, R | D]]:
    """Run the decorated function on local rank ``index`` of each machine only.

    Example:
        >>> @accel.on_local_process(0)
        ... def per_machine(): ...
    """
    wanted = _index("on_local_process", index)
    label = f"on_local_process({wanted})"

    def decorate(function: Callable[P, R]) -> Callable[P, R | D]:
        return _gate(label, lambda st: st.local_rank == wanted, function, default)

    return decorate


@contextmanager
def _leader_first(op: str, local: bool) -> Iterator[None]:
    begin(op, arrive="arrival_timeout")  # refuses to start inside a gate; a collective
    st = state()
    label = f"accel.{op}() block"
    if st.world_size == 1:
        with gated(label):
            yield
        return
    is_leader = st.is_local_main_process if local else st.is_main_process
    if is_leader:
        try:
            with gated(label):
                yield
        except BaseException as exc:
            gather_object((st.node_rank, st.local_rank, st.rank, f"{type(exc).__name__}: {exc}"))
            raise
        gather_object((st.node_rank, st.local_rank, st.rank, None))
        return
    reports = gather_object((st.node_rank, st.local_rank, st.rank, None))
    for node_rank, local_rank, rank, error in reports:
        mine = node_rank == st.node_rank and local_rank == 0 if local else rank == 0
        if mine and error is not None:
            raise MainProcessFirstError(
                f"Rank {rank} raised inside `accel.{op}()` before this rank ({st.rank}) could "
                f"run the block: {error}. Fix the error on rank {rank}; this rank stopped "
                "instead of waiting forever."
            )
    with gated(label):
        yield


def main_process_first() -> AbstractContextManager[None]:
    """Run the block on the main process first, then on the others (e.g. dataset caching).

    Every rank must enter it. If the main process raises inside, the other ranks raise
    :class:`MainProcessFirstError` instead of hanging.

    Example:
        >>> with accel.main_process_first():
        ...     dataset = load_and_cache(path)
    """
    return _leader_first("main_process_first", local=False)


def local_main_process_first() -> AbstractContextManager[None]:
    """Like :func:`main_process_first`, with the first process of each machine going first.

    Example:
        >>> with accel.local_main_process_first():
        ...     tokenizer = download(name)
    """
    return _leader_first("local_main_process_first", local=True)


def print(*args: Any, **kwargs: Any) -> None:
    """``print`` once per machine (on each local main process).

    Example:
        >>> accel.print("epoch", epoch, "loss", loss.item())
    """
    if state().is_local_main_process:
        builtins.print(*args, **kwargs)


class MultiProcessAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger that logs on the main process only unless told otherwise per call.

    Per-call keywords: ``main_process_only`` (default: the adapter's), ``in_order`` (every
    rank logs, one rank after another; a collective, so call it on every rank).
    """

    def __init__(self, logger: logging.Logger, *, main_process_only: bool = True) -> None:
        super().__init__(logger, {})
        self.main_process_only = main_process_only

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        main_only = kwargs.pop("main_process_only", self.main_process_only)
        in_order = kwargs.pop("in_order", False)
        # Skip this frame so records carry the caller's file and line.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        st = state()
        if in_order:
            for rank in range(st.world_size):
                if rank == st.rank and self.isEnabledFor(level):
                    self.logger.log(level, msg, *args, **kwargs)
                wait_for_everyone()
            return
        if (not main_only or st.is_main_process) and self.isEnabledFor(level):
            self.logger.log(level, msg, *args, **kwargs)


def get_logger(
    name: str, log_level: int | str | None = None, *, main_process_only: bool = True
) -> MultiProcessAdapter:
    """A ``logging`` adapter that logs on the main process only by default.

    Example:
        >>> logger = accel.get_logger(__name__)
        >>> logger.info("once")
        >>> logger.info("rank %d", accel.state().rank, main_process_only=False)
        >>> logger.info("one after another", in_order=True)
    """
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"accel.get_logger() takes the logger's name, got {type(name).__name__} "
            f"{name!r:.60}. Pass a string, e.g. `accel.get_logger(__name__)`."
        )
    logger = logging.getLogger(name)
    if log_level is not None:
        try:
            logger.setLevel(log_level.upper() if isinstance(log_level, str) else log_level)
        except (TypeError, ValueError):
            raise ConfigError(
                f"log_level={log_level!r} is not a logging level; pass e.g. 'INFO', 'DEBUG' "
                "or logging.INFO: `accel.get_logger(__name__, log_level='INFO')`."
            ) from None
    return MultiProcessAdapter(logger, main_process_only=main_process_only)


"""Failure reports of launched workers: the first failing rank, its exit and its traceback.

``accel launch`` and the notebook launchers both read torch's elastic failure records through
:func:`describe_failure`; :func:`is_peer_loss` tells a root cause from a rank that only lost
its peer.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["describe_failure", "exit_text", "is_peer_loss"]


def exit_text(code: int) -> str:
    """How a process ended, from its exit code (negative: minus the signal that killed it).

    Example:
        >>> exit_text(1), exit_text(-9)
        ('exit code 1', 'killed by signal SIGKILL')
    """
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _traceback_of(message: object) -> str | None:
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        if isinstance(extra, dict) and isinstance(extra.get("py_callstack"), str):
            return str(extra["py_callstack"])
        text = message.get("message")
        return str(text) if text else None
    return None


def _precise_time(message: object) -> float | None:
    if isinstance(message, dict) and isinstance(message.get("extraInfo"), dict):
        try:
            return float(message["extraInfo"]["accel_time"])
        except (KeyError, TypeError, ValueError):
            return None
    return None


# the end of a traceback raised because another rank died first (not a root cause)
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "remote worker", "DistBackendError", "NCCL communicator was aborted")


def is_peer_loss(traceback_text: str) -> bool:
    """Whether a traceback ends in a communication error caused by another rank's death.

    Example:
        >>> is_peer_loss("RuntimeError: ... Connection reset by peer ...")
        True
    """
    tail = traceback_text.rstrip().rsplit("\n", 1)[-1]
    return any(marker in tail for marker in _PEER_LOST)


def _first_failure(error: ChildFailedError) -> tuple[int, Any]:
    """The root-cause rank: a real error before a lost peer or a rank the launcher stopped.

    Ranks the elastic agent terminates after the first failure (SIGTERM, no traceback) can
    carry the same or an earlier timestamp than the rank that raised, so they rank last.
    """
    def order(item: tuple[int, Any]) -> tuple[bool, bool, float]:
        failure = item[1]
        trace = _traceback_of(failure.message) or ""
        precise = _precise_time(failure.message)
        stopped = not trace and failure.exitcode == -signal.SIGTERM
        when = float(failure.timestamp) if precise is None else precise
        return is_peer_loss(trace), stopped, when

    return min(error.failures.items(), key=order)


def describe_failure(error: ChildFailedError, what: str) -> tuple[str, int]:
    """A readable report of failed workers, and the exit code the launcher should return.

    The exit code is the first failing rank's (1 when it raised), or 128 + the signal number
    when it was killed.

    Example:
        >>> text, code = describe_failure(error, "train.py")
        >>> print(text)  # doctest: +SKIP
        accel launch: train.py failed on rank 1 (local rank 1, pid 7): raised ValueError: x
        ...
    """
    first_rank, first = _first_failure(error)
    lines = []
    for rank, failure in sorted(error.failures.items()):
        how = exit_text(failure.exitcode)
        raised = _traceback_of(failure.message)
        if raised:
            last = raised.rstrip().rsplit("\n", 1)[-1]
            how = f"raised {last}" + (f" ({how})" if failure.exitcode != 1 else "")
        mark = " (first failure)" if rank == first_rank and len(error.failures) > 1 else ""
        lines.append(f"accel launch: {what} failed on rank {rank} (local rank "
                     f"{failure.local_rank}, pid {failure.pid}): {how}{mark}")
    trace = _traceback_of(first.message)
    if trace:
        lines += [f"----- traceback of rank {first_rank} -----", trace.rstrip("\n"),
                  "-" * 40]
    elif first.exitcode < 0:
        lines.append(f"Rank {first_rank} raised no Python exception: it was "
                     f"{exit_text(first.exitcode)} (SIGKILL often means out of memory).")
    else:
        lines.append(f"Rank {first_rank} exited without a Python exception (sys.exit or "
                     "os._exit); its own output is above.")
    if first.exitcode > 0:
        code = first.exitcode
    elif first.exitcode < 0 and not trace:
        code = 128 - first.exitcode
    else:  # raised, then stopped by the launcher while exiting
        code = 1
    return "\n".join(lines) + "\n", code

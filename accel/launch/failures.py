"""Failure reports of launched workers: the first failing rank, its exit and its traceback.

``accel launch`` and the notebook launchers both read torch's elastic failure records through
:func:`describe_failure`; :func:`is_peer_loss` tells a root cause from a rank that only lost
its peer. An exception's message is kept whole, up to :data:`MESSAGE_LINES` lines and
:data:`MESSAGE_CHARS` characters (then a ``... (N more lines)`` marker); a rank killed by a
signal is described by what that signal usually means, and SIGKILL as "out of memory" only
when the kernel's OOM-kill counters (:mod:`accel.launch.oom`) rose during the job.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from accel.launch.oom import OomEvidence

__all__ = ["MESSAGE_CHARS", "MESSAGE_LINES", "describe_failure", "exit_text", "is_peer_loss"]

# an exception message in a report: at most this much of it (a long one is cut, and says so)
MESSAGE_LINES = 40
MESSAGE_CHARS = 4096
# the traceback frames above the message: at most its last this many lines/characters
_FRAME_LINES = 200
_FRAME_CHARS = 16384
_SUMMARY_CHARS = 300  # the first failure's summary line (its traceback holds the message)


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
              "remote worker", "DistBackendError", "NCCL communicator was aborted",
              "MachineLostError")


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


def _raised(message: object) -> str | None:
    """The exception's text (``Type: message``, every line of it) from a failure record."""
    if isinstance(message, dict):
        text = message.get("message")
        if isinstance(text, str) and text.strip():
            return text.strip("\n")
    trace = _traceback_of(message)
    return trace.rstrip().rsplit("\n", 1)[-1] if trace else None  # another writer's record


def _clip_head(text: str, max_lines: int, max_chars: int) -> str:
    """``text`` up to ``max_lines`` lines and ``max_chars`` characters, then a marker."""
    lines = text.split("\n")
    kept: list[str] = []
    used = 0
    for line in lines[:max_lines]:
        room = max_chars - used
        if len(line) > room:
            kept.append(f"{line[:room]} ... ({len(line) - room} more characters)")
            break
        kept.append(line)
        used += len(line) + 1
    if len(lines) > len(kept):
        kept.append(f"... ({len(lines) - len(kept)} more lines)")
    return "\n".join(kept)


def _clip_tail(text: str, max_lines: int, max_chars: int) -> str:
    """The last ``max_lines`` lines of ``text`` (at most ``max_chars``), after a marker."""
    lines = text.split("\n")
    kept: list[str] = []
    used = 0
    for line in reversed(lines[-max_lines:]):
        if used + len(line) > max_chars:
            if not kept:  # one line longer than the bound: its start
                kept.append(f"{line[:max_chars]} ... ({len(line) - max_chars} more characters)")
            break
        kept.append(line)
        used += len(line) + 1
    if len(lines) > len(kept):
        kept.append(f"... ({len(lines) - len(kept)} earlier lines; the rank's own output "
                    "above has them)")
    return "\n".join(reversed(kept))


def _bounded_traceback(trace: str, raised: str | None) -> str:
    """The traceback, its frames and its message each bounded (the message kept from its
    start, the frames from their end: the innermost ones)."""
    trace = trace.rstrip("\n")
    if raised and trace.endswith(raised):
        frames = trace[: len(trace) - len(raised)].rstrip("\n")
        message = _clip_head(raised, MESSAGE_LINES, MESSAGE_CHARS)
        if not frames:
            return message
        return _clip_tail(frames, _FRAME_LINES, _FRAME_CHARS) + "\n" + message
    return _clip_tail(trace, _FRAME_LINES + MESSAGE_LINES, _FRAME_CHARS + MESSAGE_CHARS)


_NATIVE = "Run it with `PYTHONFAULTHANDLER=1` to print the Python stack where it died."

# what a death by each signal usually means, by name (SIGKILL: see _killed_cause)
_SIGNAL_CAUSES = {
    "SIGABRT": "It aborted: often a C++ library's fatal error, such as a collective that "
               "failed (ranks that sent different sizes, a lost peer); the library's own "
               "message is in the rank's output above. " + _NATIVE,
    "SIGSEGV": "A segmentation fault in native code (a C/C++ extension or library). " + _NATIVE,
    "SIGBUS": "A bus error in native code (e.g. a memory-mapped file that shrank, or a full "
              "/dev/shm). " + _NATIVE,
    "SIGFPE": "An arithmetic fault in native code. " + _NATIVE,
    "SIGILL": "An illegal instruction in native code (a library built for another CPU?). "
              + _NATIVE,
    "SIGTERM": "Another process stopped it (a scheduler's time limit, `kill`).",
    "SIGINT": "It was interrupted (Ctrl-C, or SIGINT from another process).",
    "SIGHUP": "Its terminal or session went away, or another process sent SIGHUP.",
}


def _killed_cause(pid: int, oom: OomEvidence | None) -> str:
    """What a SIGKILL means: out of memory only where the kernel counted an OOM kill."""
    if oom is not None:
        where = ("in the launcher's memory cgroup" if oom.scope == "cgroup"
                 else "on this machine")
        if oom.kills:
            likely = "" if oom.scope == "cgroup" else "likely "
            return (f"It {likely}ran out of memory: the kernel's OOM killer ended "
                    f"{oom.kills} process(es) {where} during the job ({oom.counted()}). "
                    "Use less memory per process (a smaller batch, fewer processes per "
                    "machine) or raise the job's memory limit.")
        known = f" No OOM kill was counted {where} ({oom.counted()})."
    else:
        known = ""
    return ("Another process sent it (a scheduler, `kill -9`), or the kernel's "
            f"out-of-memory killer did.{known} Check `dmesg` (or `journalctl -k`) for "
            f"\"Killed process {pid}\", and the job's memory limit.")


def _signal_cause(rank: int, failure: Any, oom: OomEvidence | None) -> str:
    """The report's line for a rank killed by a signal: the signal, then what it means."""
    text = f"Rank {rank} raised no Python exception: it was {exit_text(failure.exitcode)}."
    try:
        name = signal.Signals(-failure.exitcode).name
    except ValueError:
        return text
    cause = _killed_cause(failure.pid, oom) if name == "SIGKILL" else _SIGNAL_CAUSES.get(name)
    return f"{text}\n{cause}" if cause else text


def describe_failure(
    error: ChildFailedError, what: str, *, oom: OomEvidence | None = None
) -> tuple[str, int]:
    """A readable report of failed workers, and the exit code the launcher should return.

    The exit code is the first failing rank's (1 when it raised), or 128 + the signal number
    when it was killed. Each rank's exception message is kept whole (bounded by
    :data:`MESSAGE_LINES` and :data:`MESSAGE_CHARS`): the first failure's in its traceback,
    the others' below their line.

    Args:
        error: torch elastic's record of the failed workers.
        what: The script (or function) that ran, for the report.
        oom: The kernel's OOM-kill counts over the job (:func:`accel.launch.oom.oom_evidence`);
            ``None``: unknown, and a SIGKILL is then never said to be out of memory.

    Example:
        >>> text, code = describe_failure(error, "train.py")
        >>> print(text)  # doctest: +SKIP
        accel launch: train.py failed on rank 1 (local rank 1, pid 7): raised ValueError: x
        ...
    """
    first_rank, first = _first_failure(error)
    trace = _traceback_of(first.message)
    lines = []
    for rank, failure in sorted(error.failures.items()):
        how = exit_text(failure.exitcode)
        raised = _raised(failure.message)
        rest: list[str] = []
        if raised:
            below = ""
            if rank == first_rank and trace:  # whole in the traceback below
                head, _, more = raised.partition("\n")
                head = _clip_head(head, 1, _SUMMARY_CHARS)
                if more:
                    below = f" (+{len(more.splitlines())} lines, in its traceback below)"
            else:
                head, *rest = _clip_head(raised, MESSAGE_LINES, MESSAGE_CHARS).split("\n")
            how = f"raised {head}" + (f" ({how})" if failure.exitcode != 1 else "") + below
        mark = " (first failure)" if rank == first_rank and len(error.failures) > 1 else ""
        lines.append(f"accel launch: {what} failed on rank {rank} (local rank "
                     f"{failure.local_rank}, pid {failure.pid}): {how}{mark}")
        lines += ["    " + line for line in rest]
    if trace:
        lines += [f"----- traceback of rank {first_rank} -----",
                  _bounded_traceback(trace, _raised(first.message)), "-" * 40]
    elif first.exitcode < 0:
        lines.append(_signal_cause(first_rank, first, oom))
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

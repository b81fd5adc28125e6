"""A requested stop of ``accel launch``: the workers' exit codes after torch's agent stops them.

torch's elastic agent already does the forwarding: on a signal it handles (``accel launch`` asks
for SIGTERM, SIGINT, SIGUSR1, SIGHUP and SIGQUIT) it sends the same signal to every worker,
waits up to its shutdown timeout (``--stop-grace-period``) and then kills the ones left with
SIGKILL. What it does not keep is how the workers ended, so the launcher could not tell a job
whose workers saved and exited 0 from one that was killed. :func:`recording_worker_exits`
records the exit codes when the agent shuts the workers down (a subclass of torch's
``LocalElasticAgent``, installed where torch's launcher looks it up, for the duration of the
run); :func:`stop_outcome` turns them into the report and the launcher's exit code. A second
signal during the grace period stops the wait: the workers still running are killed at once.
"""

from __future__ import annotations

import signal
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from accel.launch.failures import exit_text

__all__ = ["FORWARDED_SIGNALS", "recording_worker_exits", "stop_outcome", "supported_stop_args"]

# the signals torch's agent handles by stopping the workers with the same signal
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP", "SIGQUIT")
TORCH_FIXED_GRACE_S = 30.0  # torch versions without --shutdown-timeout wait this long
_STOP_FLAGS = ("--signals-to-handle", "--shutdown-timeout")


def _torchrun_options() -> set[str]:
    import torch.distributed.run as torchrun

    parser = torchrun.get_args_parser()
    return {option for action in parser._actions for option in action.option_strings}


def supported_stop_args(args: Sequence[str], known: Collection[str] | None = None
                        ) -> tuple[list[str], float, str]:
    """Drop the stop options this torch's launcher does not have (older torch versions).

    Returns the arguments to run, the grace period the workers will get and a note for the
    user ("" when nothing was dropped). ``known``: torchrun's options (default: read them).

    Example:
        >>> supported_stop_args(["--shutdown-timeout", "60", "x.py"])[:2]
        (['--shutdown-timeout', '60', 'x.py'], 60.0)
    """
    known = _torchrun_options() if known is None else known
    out, dropped = list(args), []

    def launcher_part() -> list[str]:  # the script's own arguments come after these
        ends = [out.index(flag) for flag in ("--module", "--no-python") if flag in out]
        return out[:min(ends)] if ends else out

    for flag in _STOP_FLAGS:
        if flag in launcher_part() and flag not in known:
            at = out.index(flag)
            del out[at:at + 2]
            dropped.append(flag)
    ours = launcher_part()
    grace = (float(ours[ours.index("--shutdown-timeout") + 1]) if "--shutdown-timeout" in ours
             else TORCH_FIXED_GRACE_S)
    note = ""
    if dropped:
        import torch

        note = (f"accel launch: torch {torch.__version__} has no {' or '.join(dropped)}: "
                "on SIGTERM/SIGINT the workers get its own fixed "
                f"{TORCH_FIXED_GRACE_S:g} s grace period"
                + (" and SIGUSR1 is not passed on" if "--signals-to-handle" in dropped else "")
                + "; a newer torch honours --stop-grace-period.\n")
    return out, grace, note


def _exit_codes(agent: Any) -> dict[int, int | None]:
    """Local rank -> exit code (negative: the signal that killed it; None: still running)."""
    handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None) or {}
    return {int(rank): handler.proc.poll() for rank, handler in handlers.items()}


@contextmanager
def recording_worker_exits() -> Iterator[dict[int, int | None]]:
    """While active, torch's launcher records the workers' exit codes when it stops them.

    Yields the dict it fills: local rank -> exit code, as the workers were when the agent's
    shutdown ended (empty when no workers were running).

    Example:
        >>> with recording_worker_exits() as exits:
        ...     torchrun.run(parsed)
    """
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    base = launcher_api.LocalElasticAgent  # type: ignore[attr-defined]
    exits: dict[int, int | None] = {}

    class RecordingAgent(base):  # type: ignore[misc, valid-type]
        def _shutdown(self, *args: Any, **kwargs: Any) -> None:  # signature varies by torch
            try:
                super()._shutdown(*args, **kwargs)
            except SignalException:  # a second signal during the grace period: kill now
                super()._shutdown(signal.SIGKILL)
                raise
            finally:
                exits.clear()
                exits.update(_exit_codes(self))

    launcher_api.LocalElasticAgent = RecordingAgent  # type: ignore[attr-defined]
    try:
        yield exits
    finally:
        launcher_api.LocalElasticAgent = base  # type: ignore[attr-defined]


def _how(code: int | None) -> str:
    return "still running" if code is None else exit_text(code)


def stop_outcome(sig: signal.Signals, exits: dict[int, int | None],
                 grace_s: float) -> tuple[str, int]:
    """The launcher's report and exit code after it stopped the workers for ``sig``.

    0 when every worker exited 0 (they stopped cleanly, e.g. after ``accel.stop_requested()``
    and ``save_state``); else 128 + the signal number.

    Example:
        >>> stop_outcome(signal.SIGTERM, {0: 0, 1: 0}, 60.0)[1]
        0
    """
    if exits and all(code == 0 for code in exits.values()):
        return (f"accel launch: stopped by {sig.name}: all {len(exits)} workers exited 0.\n", 0)
    lines = [f"accel launch: stopped by {sig.name}; workers terminated."]
    for rank, code in sorted(exits.items()):
        note = ""
        if code == -signal.SIGKILL:
            note = (f" (still running after the {grace_s:g} s grace period, or a second "
                    "signal: give more time with `--stop-grace-period SECONDS`)")
        lines.append(f"accel launch: local rank {rank}: {_how(code)}{note}")
    return "\n".join(lines) + "\n", 128 + int(sig)

"""The result of :func:`accel.testing.run_script`: each rank's exit code and output."""

from __future__ import annotations

from pathlib import Path

import attrs

from accel.errors import CollectiveTimeoutError, LaunchError
from accel.launch.failures import exit_text

__all__ = ["ScriptResult", "tail"]

_TAIL_LINES = 40  # lines of a rank's output quoted in an error


@attrs.frozen(kw_only=True)
class ScriptResult:
    """What each rank of a :func:`run_script` run did (tuples are indexed by rank).

    Attributes:
        script: the script as given.
        args: its arguments.
        exit_codes: each rank's exit status: the script's ``sys.exit`` code (1 after an
            uncaught exception), or minus the signal that killed it (``-9``: killed at the
            timeout, or after another rank failed).
        stdout: each rank's standard output.
        stderr: each rank's standard error.
        timeout: the run's timeout, in seconds.
        timed_out: the run reached its timeout and the ranks still running were killed.
        killed: the ranks killed here: still running at the timeout, or a few seconds after
            another rank failed.
        failed_rank: the first failing rank (a rank that only lost its connection to a failed
            peer is not taken for the cause), or ``None``.
        traceback: that rank's Python traceback, trimmed to the script's frames as
            ``accel launch`` reports it; ``None`` when it exited without an exception.
    """

    script: str
    args: tuple[str, ...]
    exit_codes: tuple[int, ...]
    stdout: tuple[str, ...]
    stderr: tuple[str, ...]
    timeout: float
    timed_out: bool = False
    killed: tuple[int, ...] = ()
    failed_rank: int | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        """Every rank exited 0 within the timeout."""
        return not self.timed_out and all(code == 0 for code in self.exit_codes)

    @property
    def output(self) -> str:
        """Every rank's standard output, one after the other in rank order."""
        return "".join(self.stdout)

    def check(self) -> ScriptResult:
        """Return this result if every rank exited 0; else raise what went wrong.

        Raises:
            CollectiveTimeoutError: the run timed out; names the ranks still running and
                quotes the end of their output.
            LaunchError: a rank failed; names the first failing rank, its exit code, and
                quotes its traceback (or the end of its standard error).

        Example:
            >>> run_script("train.py", check=False).check().exit_codes
            (0, 0)
        """
        if self.timed_out:
            raise CollectiveTimeoutError(self._describe_timeout())
        if self.failed_rank is not None:
            raise LaunchError(self._describe_failure(self.failed_rank))
        return self

    def _describe_failure(self, rank: int) -> str:
        code = self.exit_codes[rank]
        how = exit_text(code)
        if self.traceback:
            last = self.traceback.rstrip().rsplit("\n", 1)[-1]
            how = f"raised {last}" + (f" ({how})" if code != 1 else "")
        lines = [f"run_script: {Path(self.script).name} failed on rank {rank} of "
                 f"{len(self.exit_codes)}: {how}.",
                 "exit codes by rank: " + ", ".join(str(c) for c in self.exit_codes)]
        if self.traceback:
            lines += [f"----- traceback of rank {rank} -----", self.traceback.rstrip("\n")]
        else:
            lines += [f"----- end of rank {rank}'s stderr -----", tail(self.stderr[rank])]
        lines.append("-" * 40)
        return "\n".join(lines)

    def _describe_timeout(self) -> str:
        hung = list(self.killed)
        command = " ".join([self.script, *self.args])
        lines = [f"run_script({command!r}) exceeded timeout={self.timeout!r}s: ranks "
                 f"{hung} were still running and were killed (exit codes by rank: "
                 + ", ".join(str(c) for c in self.exit_codes) + "). Look for a collective "
                 "called on only some ranks, or pass a larger `timeout=`. (A rank still running "
                 "shortly before the timeout wrote its Python stack to its stderr.)"]
        for rank in hung:
            lines += [f"----- end of rank {rank}'s stdout -----", tail(self.stdout[rank]),
                      f"----- end of rank {rank}'s stderr -----", tail(self.stderr[rank])]
        return "\n".join(lines)


def tail(text: str) -> str:
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-_TAIL_LINES:]) if lines else "(nothing)"

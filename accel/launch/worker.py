"""The entry point ``accel launch`` runs in every worker: the user's script, failures recorded.

``python -m accel.cli.worker script.py [args]`` (or ``-m module [args]``) runs the script
as ``__main__`` exactly like ``python script.py`` would. When it raises, the traceback (trimmed
to the user's frames) is printed as usual *and* written to torch elastic's per-worker error file
(``$TORCHELASTIC_ERROR_FILE``), so the launcher can report it instead of ``error_file: <N/A>``.

Only the standard library is imported here, so the worker starts as fast as ``python script.py``.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from accel.launch.parent_death import die_with_parent

__all__ = ["main", "user_frames"]


def user_frames(tb: TracebackType | None, filename: str | None) -> TracebackType | None:
    """Skip the frames of this module and runpy, up to the first frame of the user's code.

    Args:
        tb: The traceback of an error the user's script raised.
        filename: The script's absolute path; ``None``: the first frame neither of this
            module nor of runpy.

    Returns:
        The traceback from the user's first frame on; ``None`` when there is none (a
        SyntaxError in the script: its message names the line).

    Example:
        >>> error.__traceback__ = user_frames(error.__traceback__, os.path.abspath("train.py"))
    """
    here = os.path.abspath(__file__)
    start = tb
    while start is not None:
        code_file = os.path.abspath(start.tb_frame.f_code.co_filename)
        if filename is not None and code_file == filename:
            return start
        if filename is None and code_file != here and "runpy" not in code_file:
            return start
        start = start.tb_next
    return None


def _record(error: BaseException, text: str) -> None:
    """Write torch elastic's error file for this worker (no-op outside a torchrun job)."""
    # imported only here, on failure, so the worker starts fast
    from accel.core.failure_record import write_failure_record

    write_failure_record(error, text)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run ``script.py args`` (or ``-m module args``) as ``__main__``, recording a failure.

    Returns the script's globals: the caller keeps them until the interpreter exits, so the
    script's objects (models, process groups) are torn down at exit as with ``python script.py``
    rather than as soon as the script ends.

    Example:
        >>> script_globals = main(["train.py", "--epochs", "1"])  # in a launched worker
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is None:  # a launched worker: it ends with its launcher, before any user code
        die_with_parent()
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m accel.cli.worker (script.py | -m module) [args ...]")
        raise SystemExit(0 if args else 2)
    filename: str | None = None
    try:
        if args[0] == "-m":
            if len(args) < 2:
                raise SystemExit("accel.launch.worker: -m needs a module name")
            sys.argv = [args[1], *args[2:]]
            return runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            filename = os.path.abspath(args[0])
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = os.path.dirname(filename)  # as `python script.py` does
            return runpy.run_path(filename, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:  # report everything, including KeyboardInterrupt
        error.__traceback__ = user_frames(error.__traceback__, filename)
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        _record(error, text)
        sys.stderr.write(text)
        sys.stderr.flush()
        raise SystemExit(130 if isinstance(error, KeyboardInterrupt) else 1) from None


if __name__ == "__main__":
    _script_globals = main()

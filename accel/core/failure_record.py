"""A worker's failure record: torch elastic's per-worker error file, for the launcher's report.

Written by ``accel launch``'s worker when the script raises, and by the liveness watch
(:mod:`accel.core.liveness`) when it ends a process whose main thread cannot raise (blocked in
a collective with a lost machine). A no-op outside a torchrun job.
"""

from __future__ import annotations

import json
import time
import traceback

from accel.core.env import read_variable

__all__ = ["write_failure_record"]


def write_failure_record(error: BaseException, text: str) -> None:
    """Write ``error`` (its message) and ``text`` (its traceback) to ``$TORCHELASTIC_ERROR_FILE``.

    Best effort: an unwritable file is ignored (the error is printed anyway).

    Example:
        >>> write_failure_record(ValueError("x"), "Traceback ...\\nValueError: x")
    """
    path = read_variable("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # the exception's text as the traceback ends with it: every line, notes included
    message = "".join(traceback.format_exception_only(type(error), error)).rstrip("\n")
    data = {
        "message": {
            "message": message,
            # torch reads whole seconds; accel_time orders failures within the same second
            "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time())),
                          "accel_time": repr(time.time())},
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(data, file)
    except OSError:
        pass

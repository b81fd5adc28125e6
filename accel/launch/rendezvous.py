"""Start-up of a job on several machines: the rendezvous bound, and the machines that never came.

``accel launch --rendezvous-timeout S`` (the config key ``rendezvous_timeout``; default 600 s,
torch's static rendezvous' own) bounds how long every machine waits at start-up for the
others: it reaches torchrun as ``--rdzv-conf timeout=S`` (static rendezvous, ``--master-addr``)
or ``join_timeout=S`` (c10d, ``--rdzv-endpoint`` / ``--nnodes MIN:MAX``); a ``--rdzv-conf`` of
the user's wins. When it runs out, torch raises a store error ("Timed out after 5 seconds
waiting for clients. 1/2 clients joined." on machine 0, a connect timeout elsewhere);
:func:`describe_rendezvous_failure` turns it into a report naming the node ranks that arrived
and those that did not.

Example:
    >>> rendezvous_conf(None, 30.0, dynamic=False)
    'timeout=30'
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence

__all__ = ["describe_rendezvous_failure", "rendezvous_conf"]


def rendezvous_conf(given: str | None, timeout: float, *, dynamic: bool) -> str:
    """torchrun's ``--rdzv-conf`` with the rendezvous bound added (the user's keys win).

    Example:
        >>> rendezvous_conf("read_timeout=60", 30.0, dynamic=True)
        'join_timeout=30,read_timeout=60'
    """
    key = "join_timeout" if dynamic else "timeout"
    parts = [part for part in (given or "").split(",") if part.strip()]
    if any(part.split("=", 1)[0].strip() == key for part in parts):
        return ",".join(parts)
    return ",".join([f"{key}={int(timeout) if timeout == int(timeout) else timeout}", *parts])


def _option(args: Sequence[str], flag: str) -> str | None:
    for index, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[index + 1]
    return None


_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
_RENDEZVOUS_MARKERS = ("waiting for clients", "clients joined", "connect", "Timed out",
                       "timed out", "RendezvousTimeoutError", "Connection refused")


def describe_rendezvous_failure(error: BaseException, torchrun_args: Sequence[str]) -> str | None:
    """A report of a start-up that timed out, naming the machines; ``None`` for another error.

    Args:
        error: what torch's launcher raised before any worker started.
        torchrun_args: the launch's torchrun arguments (node rank, machine 0, the bound).

    Example:
        >>> error = RuntimeError("Timed out ... waiting for clients. 1/2 clients joined.")
        >>> print(describe_rendezvous_failure(error, ["--nnodes", "2", "--node-rank", "0"]))
        ... # doctest: +SKIP
        accel launch: machines never arrived within rendezvous_timeout=5s: node ranks [1] ...
    """
    text = f"{type(error).__name__}: {error}"
    if not any(marker in text for marker in _RENDEZVOUS_MARKERS):
        return None
    nnodes = _option(torchrun_args, "--nnodes") or "?"
    node = _option(torchrun_args, "--node-rank")
    addr = _option(torchrun_args, "--master-addr") or _option(torchrun_args, "--rdzv-endpoint")
    port = _option(torchrun_args, "--master-port")
    conf = _option(torchrun_args, "--rdzv-conf") or ""
    bound = re.search(r"(?:join_)?timeout=([0-9.]+)", conf)
    seconds = f"{bound.group(1)}s" if bound else "its default"
    where = f"{addr}:{port}" if port else str(addr)
    host = socket.gethostname()
    fix = ("Start `accel launch` on every machine (the same --nnodes and --master-addr, "
           "each its own --node-rank), check that machine 0's address and port are reachable "
           "from the others (firewall, a name that resolves to 127.0.0.1), or give the "
           "machines longer: `accel launch --rendezvous-timeout 1200` (or "
           "`rendezvous_timeout` in the config file).")
    joined = _JOINED.search(text)
    if joined and nnodes.isdigit():
        came, total = int(joined.group(1)), int(nnodes)
        if came == 1:
            missing = f"node ranks {list(range(1, total))}" if total > 2 else "node rank 1"
            arrived = f"only this one, node rank 0 (host {host!r})"
        else:
            missing = f"{total - came} of node ranks 1..{total - 1}"
            arrived = f"{came} of {total} (node rank 0, host {host!r}, among them)"
        return (f"accel launch: machines never arrived within rendezvous_timeout={seconds}: "
                f"{missing} did not connect to machine 0's store at {where}; arrived: "
                f"{arrived}.\n{fix}\n(torch: {text.strip()})\n")
    if node is not None and node != "0":
        return (f"accel launch: machine 0 (the job's store at {where}) could not be reached "
                f"from node rank {node} (host {host!r}) within rendezvous_timeout={seconds}: "
                f"it never arrived (its `accel launch` did not start or failed), or the address "
                f"is unreachable from here.\n{fix}\n(torch: {text.strip()})\n")
    return (f"accel launch: the machines did not all arrive within rendezvous_timeout={seconds} "
            f"(this is node rank {node or 0}, host {host!r}; machine 0's store at {where}).\n"
            f"{fix}\n(torch: {text.strip()})\n")

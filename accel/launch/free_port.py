"""The port of the workers' store in an elastic job, found without binding ``localhost``.

With the c10d rendezvous and a store of its own per attempt (``accel launch`` sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` when the job may restart, see
:mod:`accel.launch.run`), torch's rendezvous picks the port of the workers' store on the node
that becomes rank 0 by binding ``localhost:0``. A machine whose loopback holds no address (a
network namespace, some containers) cannot bind it, and the launcher dies at start-up with
``RuntimeError: Failed to create a socket``. The port is meant for the node's own address, so
the probe here binds the wildcard address instead: a port free on every interface, the node's
address included (which ``localhost`` alone did not promise either).

:func:`use_wildcard_free_port` installs it in the launcher process only (the workers never
pick that port), before torch's elastic agent runs.
"""

from __future__ import annotations

import socket
from contextlib import closing

__all__ = ["use_wildcard_free_port", "wildcard_free_port"]


def wildcard_free_port() -> int:
    """A TCP port that is free on every interface of this machine (not reserved: the caller
    binds it soon after, as torch's own probe does).

    Raises:
        OSError: no socket can be bound at all.

    Example:
        >>> 0 < wildcard_free_port() < 65536
        True
    """
    error: OSError | None = None
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with closing(socket.socket(family, socket.SOCK_STREAM)) as sock:
                sock.bind((address, 0))
                port: int = sock.getsockname()[1]
                return port
        except OSError as caught:  # e.g. an IPv6-only machine, or IPv6 off
            error = caught
    assert error is not None
    raise error


def use_wildcard_free_port() -> None:
    """Make torch's rendezvous (in this process) pick the workers' store port with
    :func:`wildcard_free_port`; a torch without that probe is left as it is.

    Example:
        >>> use_wildcard_free_port()  # in the launcher, before torch.distributed.run.run
    """
    try:
        from torch.distributed.elastic.rendezvous import api
    except ImportError:  # pragma: no cover - torch without elastic
        return
    if callable(getattr(api, "get_free_port", None)):
        api.get_free_port = wildcard_free_port  # type: ignore[attr-defined]

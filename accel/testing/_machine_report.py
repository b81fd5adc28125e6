"""What :mod:`accel.testing.machines` reads about its machines: their TCP sockets (from the
kernel's tables of a machine's namespace) and SLURM's compressed node list."""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path

import attrs

__all__ = ["Socket", "nodelist", "sockets_of"]

# /proc/net/tcp's "st" column (include/net/tcp_states.h)
_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
           6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
           11: "CLOSING"}


@attrs.frozen
class Socket:
    """One TCP socket of a machine: local and remote ``(address, port)`` and its state."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: str

    @property
    def loopback(self) -> bool:
        """Whether either end is a loopback address (127.0.0.0/8, ::1)."""
        return any(ipaddress.ip_address(a).is_loopback for a, _ in (self.local, self.remote))


def _address(text: str) -> tuple[str, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        address = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four little-endian 32-bit words
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        address = socket.inet_ntop(socket.AF_INET6, words)
        mapped = ipaddress.IPv6Address(address).ipv4_mapped
        address = str(mapped) if mapped is not None else address
    return address, int(port, 16)


def sockets_of(pid: int) -> list[Socket]:
    """The TCP sockets (v4 and v6) in the network namespace of process ``pid``.

    Example:
        >>> [s.state for s in sockets_of(os.getpid()) if s.local[1] == 22]
        ['LISTEN']
    """
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            found.append(Socket(_address(fields[1]), _address(fields[2]),
                                _STATES.get(int(fields[3], 16), fields[3])))
    return found


def nodelist(hostnames: list[str]) -> str:
    """SLURM's compressed form of a list of hosts: ``["m0", "m1", "m2"]`` -> ``"m[0-2]"``.

    Names that are not one prefix and numbers of one width are joined by commas.

    Example:
        >>> nodelist(["node08", "node09", "node11"])
        'node[08-09,11]'
    """
    parts = [re.fullmatch(r"(.*?)(\d+)", name) for name in hostnames]
    if not hostnames or any(p is None for p in parts) or len(
            {(p.group(1), len(p.group(2))) for p in parts if p is not None}) != 1:
        return ",".join(hostnames)
    prefix = parts[0].group(1) if parts[0] is not None else ""
    width = len(parts[0].group(2)) if parts[0] is not None else 0
    numbers = sorted(int(p.group(2)) for p in parts if p is not None)
    ranges: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        ranges.append(f"{start:0{width}d}" if start == prev
                      else f"{start:0{width}d}-{prev:0{width}d}")
        if n is not None:
            start = prev = n
    return f"{prefix}[{','.join(ranges)}]"

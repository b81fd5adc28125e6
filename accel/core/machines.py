"""The job's machines by name: who runs which ranks, at which addresses, and which one an
address belongs to.

Every process of a job on several machines publishes one small record to the job's store at
the start of ``accel.distributed()`` (:func:`this_peer`, :func:`encode_peer`): its rank, its
node rank, its hostname and the addresses its machine is reached at (the one its traffic to the
store's host leaves from, and those its hostname resolves to: gloo binds to the latter). With
the records of every rank, any error can name machines instead of addresses:
:func:`machines_of` groups them by machine, :func:`machines_at` finds the machine behind an
address such as the ``[198.18.9.2]:51936`` of gloo's "Read error ... Connection reset by
peer" (:func:`failed_address`), and :func:`describe_machine` writes one for a message.

Everything here but :func:`this_peer` is pure.

Example:
    >>> peers = [Peer(0, 0, "node0", ("198.18.9.1",)), Peer(1, 1, "node1", ("198.18.9.2",))]
    >>> [describe_machine(m) for m in machines_at("198.18.9.2", machines_of(peers), 0)]
    ["machine 'node1' (node rank 1, ranks [1])"]
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterable, Sequence

import attrs

__all__ = [
    "Machine",
    "Peer",
    "decode_peer",
    "describe_machine",
    "encode_peer",
    "failed_address",
    "machines_at",
    "machines_of",
    "this_peer",
]


@attrs.frozen
class Peer:
    """One process of the job: its rank, its machine's node rank, hostname and addresses."""

    rank: int
    node_rank: int
    hostname: str
    addresses: tuple[str, ...]


@attrs.frozen
class Machine:
    """One machine of the job: its node rank, hostname, ranks and addresses."""

    node_rank: int
    hostname: str
    ranks: tuple[int, ...]
    addresses: tuple[str, ...]


def _route_address(host: str | None) -> str | None:
    """The local address this machine's traffic to ``host`` leaves from (no packet is sent)."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP connect: a route lookup only
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _hostname_addresses(hostname: str) -> list[str]:
    try:
        return list(socket.gethostbyname_ex(hostname)[2])
    except OSError:
        return []


def this_peer(rank: int, node_rank: int, store_host: str | None) -> Peer:
    """This process's record: its hostname and its machine's addresses as peers see them.

    Args:
        rank: this process's global rank.
        node_rank: its machine's node rank.
        store_host: the job's store host (``MASTER_ADDR``): the address traffic to it leaves
            from is the machine's address on the job's network.

    Example:
        >>> this_peer(0, 0, "127.0.0.1").addresses[0]
        '127.0.0.1'
    """
    hostname = socket.gethostname()
    found = [_route_address(store_host), *_hostname_addresses(hostname)]
    addresses = tuple(dict.fromkeys(a for a in found if a))
    return Peer(rank, node_rank, hostname, addresses)


def encode_peer(peer: Peer) -> str:
    """The record as the store holds it (JSON).

    Example:
        >>> encode_peer(Peer(1, 1, "node1", ("198.18.9.2",)))
        '{"rank": 1, "node_rank": 1, "hostname": "node1", "addresses": ["198.18.9.2"]}'
    """
    return json.dumps({"rank": peer.rank, "node_rank": peer.node_rank,
                       "hostname": peer.hostname, "addresses": list(peer.addresses)})


def decode_peer(raw: bytes | str) -> Peer | None:
    """A record read back from the store; ``None`` for anything that is not one.

    Example:
        >>> decode_peer(b'{"rank": 1, "node_rank": 1, "hostname": "n", "addresses": []}').rank
        1
    """
    try:
        data = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not isinstance(data, dict):
        return None
    rank, node, host, addresses = (data.get(k) for k in ("rank", "node_rank", "hostname",
                                                         "addresses"))
    if not (isinstance(rank, int) and isinstance(node, int) and isinstance(host, str)
            and isinstance(addresses, list) and all(isinstance(a, str) for a in addresses)):
        return None
    return Peer(rank, node, host, tuple(addresses))


def machines_of(peers: Iterable[Peer]) -> tuple[Machine, ...]:
    """The machines of these processes, by node rank (a machine's first record names it).

    Example:
        >>> machines_of([Peer(0, 0, "a", ("10.0.0.1",)), Peer(1, 0, "a", ("10.0.0.1",))])
        (Machine(node_rank=0, hostname='a', ranks=(0, 1), addresses=('10.0.0.1',)),)
    """
    by_node: dict[int, list[Peer]] = {}
    for peer in sorted(peers, key=lambda p: p.rank):
        by_node.setdefault(peer.node_rank, []).append(peer)
    return tuple(
        Machine(node, group[0].hostname, tuple(p.rank for p in group),
                tuple(dict.fromkeys(a for p in group for a in p.addresses)))
        for node, group in sorted(by_node.items())
    )


# gloo's transport errors: "Read error [198.18.9.2]:51936: Connection reset by peer"
_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
_LOST_LINK = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Connection refused", "Socket closed", "No route to host", "Connection timed out")


def failed_address(text: str) -> tuple[str, str] | None:
    """The peer address and the failure of a collective's transport error, if it is one.

    Example:
        >>> failed_address("Read error [198.18.9.2]:51936: Connection reset by peer")
        ('198.18.9.2', 'Connection reset by peer')
    """
    found = _ADDRESS.search(text)
    if found is None:
        return None
    why = next((marker for marker in _LOST_LINK if marker in text), None)
    return None if why is None else (found.group(1), why)


def machines_at(address: str, machines: Sequence[Machine], own_node: int) -> list[Machine]:
    """The machines that may be behind ``address``: those that have it, other than this one
    when several do (machines on one host's loopback all have 127.0.0.1); none when only this
    machine has it (a process of this machine's own).

    Example:
        >>> m = machines_of([Peer(0, 0, "a", ("127.0.0.1",)), Peer(1, 1, "b", ("127.0.0.1",))])
        >>> [x.node_rank for x in machines_at("127.0.0.1", m, own_node=0)]
        [1]
    """
    having = [m for m in machines if address in m.addresses]
    return [m for m in having if m.node_rank != own_node]


def describe_machine(machine: Machine) -> str:
    """``machine 'node1' (node rank 1, ranks [2, 3])``, for messages.

    Example:
        >>> describe_machine(Machine(1, "node1", (2, 3), ()))
        "machine 'node1' (node rank 1, ranks [2, 3])"
    """
    return (f"machine {machine.hostname!r} (node rank {machine.node_rank}, "
            f"ranks {list(machine.ranks)})")

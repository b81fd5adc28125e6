"""The liveness watch's pure parts: machine records and addresses, the hearing and verdict on a
fake clock, one Watch round on a fake store, the bounds, and the start-up report."""

from __future__ import annotations

from typing import Any

import pytest

from accel.core.env import LaunchEnv
from accel.core.liveness import Hearing, LivenessBounds, Watch, hear, liveness_bounds, verdict
from accel.core.machines import (
    Peer,
    decode_peer,
    encode_peer,
    failed_address,
    machines_at,
    machines_of,
)
from accel.errors import ConfigError, MachineLostError
from accel.launch.failures import is_peer_loss
from accel.launch.rendezvous import describe_rendezvous_failure, rendezvous_conf

PEERS = [Peer(0, 0, "m0", ("198.18.9.1",)), Peer(1, 0, "m0", ("198.18.9.1",)),
         Peer(2, 1, "m1", ("198.18.9.2",)), Peer(3, 1, "m1", ("198.18.9.2",))]
NODES = {p.rank: p.node_rank for p in PEERS}
GLOO = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [198.18.9.2]:51936: "
        "Connection reset by peer")


def test_records_round_trip_and_junk_is_refused() -> None:
    assert decode_peer(encode_peer(PEERS[2])) == PEERS[2]
    for junk in (b"", b"[]", b'{"rank": "1"}', b"\x80abc", b'{"rank": 1, "node_rank": 1, '
                 b'"hostname": "x", "addresses": [3]}'):
        assert decode_peer(junk) is None


def test_an_address_names_its_machine() -> None:
    machines = machines_of(PEERS)
    assert [(m.node_rank, m.ranks) for m in machines] == [(0, (0, 1)), (1, (2, 3))]
    address, why = failed_address(GLOO) or ("", "")
    assert (address, why) == ("198.18.9.2", "Connection reset by peer")
    assert [m.hostname for m in machines_at(address, machines, own_node=0)] == ["m1"]
    assert machines_at("198.18.9.1", machines, own_node=0) == []  # this machine's own
    assert failed_address("ValueError: [1]:2 bad shape") is None  # no transport failure
    loop = machines_of([Peer(0, 0, "a", ("127.0.0.1",)), Peer(1, 1, "b", ("127.0.0.1",))])
    assert [m.node_rank for m in machines_at("127.0.0.1", loop, own_node=1)] == [0]


def test_a_machine_is_heard_while_any_of_its_ranks_stamps() -> None:
    h = Hearing.first(0.0, NODES)
    h = hear(h, {0: 1, 1: 1, 2: 1, 3: 1}, NODES, 1.0)
    h = hear(h, {0: 2, 1: 2, 2: 1, 3: 2}, NODES, 9.0)  # rank 2 silent, rank 3 stamps
    assert verdict(h, 15.0, 10.0, NODES, own_node=0, store_node=0) is None
    h = hear(h, {0: 3, 1: 3, 2: 1, 3: 2}, NODES, 12.0)  # machine 1 silent since 9.0
    assert verdict(h, 18.0, 10.0, NODES, own_node=0, store_node=0) is None
    assert verdict(h, 19.0, 10.0, NODES, own_node=0, store_node=0) == (1, 10.0, False)
    assert verdict(h, 19.0, 0.0, NODES, own_node=0, store_node=0) is None  # watch off


def test_the_store_unanswered_names_its_machine_and_left_ranks_are_not_lost() -> None:
    h = hear(Hearing.first(0.0, NODES), {0: 1, 1: 1, 2: 1, 3: 1}, NODES, 1.0)
    assert verdict(h, 12.0, 10.0, NODES, own_node=1, store_node=0) == (0, 11.0, True)
    assert verdict(h, 12.0, 10.0, NODES, own_node=0, store_node=0) == (1, 11.0, False)
    left = hear(h, {0: 2, 1: 2, 2: -1, 3: -1}, NODES, 2.0)
    left = hear(left, {0: 3, 1: 3, 2: -1, 3: -1}, NODES, 30.0)
    assert verdict(left, 40.0, 5.0, NODES, own_node=0, store_node=0) is None


def test_a_cut_link_to_the_store_machine_is_named_as_the_store_even_when_its_stamp_lags() -> None:
    # The store last answered at 10.0 with machine 0's counters unchanged (its ranks stamp
    # between this watch's reads), so machine 0 was last heard at 9.0; then the link is cut.
    h = hear(Hearing.first(0.0, NODES), {0: 1, 1: 1, 2: 1, 3: 1}, NODES, 9.0)
    h = hear(h, {0: 1, 1: 1, 2: 2, 3: 2}, NODES, 10.0)
    # At 19.0 machine 0 is 10 s unheard, the store 9 s unanswered: the store's machine is lost.
    assert verdict(h, 19.0, 10.0, NODES, own_node=1, store_node=0, interval=1.0) == (0, 9.0, True)
    # A store that still answers (only machine 0's processes are gone) is no store loss.
    alive = hear(h, {0: 1, 1: 1, 2: 3, 3: 3}, NODES, 18.5)
    assert verdict(alive, 19.0, 10.0, NODES, own_node=1, store_node=0,
                   interval=1.0) == (0, 10.0, False)


class FakeStore:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False

    def _up(self) -> None:
        if self.down:
            raise RuntimeError("Socket Timeout")

    def add(self, key: str, n: int) -> int:
        self._up()
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self._up()
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        self._up()
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._up()
        return [self.data[k] for k in keys]


def _watch(store: FakeStore, clock: list[float], rank: int, node: int) -> Watch:
    watch = Watch(store, rank=rank, world_size=2, node_rank=node,
                  bounds=LivenessBounds(1.0, 10.0), store_address="m0:29500",
                  clock=lambda: clock[0])
    watch.publish(Peer(rank, node, f"m{node}", (f"198.18.9.{node + 1}",)))
    return watch


def test_a_watch_round_names_a_silent_machine_and_an_unreachable_store() -> None:
    store, clock = FakeStore(), [100.0]
    zero, one = _watch(store, clock, 0, 0), _watch(store, clock, 1, 1)
    for _ in range(3):
        clock[0] += 1
        assert zero.tick() is None and one.tick() is None
    for _ in range(12):  # machine 1 stops stamping (killed, stopped, cut off)
        clock[0] += 1
        lost = zero.tick()
    assert isinstance(lost, MachineLostError)
    assert "Lost machine 'm1' (node rank 1, ranks [1])" in str(lost)
    assert "liveness_timeout=10s" in str(lost) and "ACCEL_LIVENESS_TIMEOUT" in str(lost)
    store.down = True  # from machine 1: the store no longer answers
    for _ in range(11):
        clock[0] += 1
        lost = one.tick()
    assert isinstance(lost, MachineLostError)
    assert "Lost machine 'm0' (node rank 0, ranks [0]), which holds the job's store" in str(lost)


def test_a_gloo_reset_is_explained_as_the_machine() -> None:
    store, clock = FakeStore(), [0.0]
    zero, one = _watch(store, clock, 0, 0), _watch(store, clock, 1, 1)
    zero.tick(), one.tick()
    lost = zero.explain(RuntimeError(GLOO))
    assert lost is not None and "Lost machine 'm1' (node rank 1, ranks [1])" in str(lost)
    assert "198.18.9.2" in str(lost) and "last heard" in str(lost)
    assert zero.explain(ValueError("a bad shape")) is None
    assert is_peer_loss(f"accel.errors.MachineLostError: {lost}")


@pytest.mark.parametrize(("given", "message"), [
    ({"liveness_timeout": 1.5}, "at least twice heartbeat_interval"),
    ({"liveness_timeout": -1}, ">= 0"),
    ({"heartbeat_interval": 0}, "heartbeat_interval"),
    ({"liveness_timeout": "soon"}, "liveness_timeout"),
])
def test_bounds_are_checked(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        liveness_bounds(LaunchEnv(), **given)


def test_bounds_defaults_environment_and_off() -> None:
    assert liveness_bounds(LaunchEnv()) == LivenessBounds(1.0, 10.0)
    env = LaunchEnv(liveness_timeout=30.0, heartbeat_interval=2.0)
    assert liveness_bounds(env) == LivenessBounds(2.0, 30.0)
    assert liveness_bounds(env, liveness_timeout=0).on is False


def test_the_rendezvous_bound_reaches_torchrun_and_its_timeout_is_named() -> None:
    assert rendezvous_conf(None, 30.0, dynamic=False) == "timeout=30"
    assert rendezvous_conf("timeout=9", 30.0, dynamic=False) == "timeout=9"  # the user's wins
    assert rendezvous_conf("a=1", 7.5, dynamic=True) == "join_timeout=7.5,a=1"
    args = ["--nnodes", "3", "--node-rank", "0", "--master-addr", "m0", "--master-port", "29500",
            "--rdzv-conf", "timeout=5"]
    error = RuntimeError("Timed out after 6 seconds waiting for clients. 1/3 clients joined.")
    report = describe_rendezvous_failure(error, args) or ""
    assert "never arrived within rendezvous_timeout=5s: node ranks [1, 2]" in report
    args[3] = "2"
    report = describe_rendezvous_failure(RuntimeError("connect() timed out"), args) or ""
    assert "could not be reached from node rank 2" in report
    assert describe_rendezvous_failure(RuntimeError("a bug"), args) is None

"""accel.testing.machines: the bed's parts on their own (fast), and real namespaced machines
(ci_extra; root): what each machine has, the link cut, SLURM's variables, and that nothing
is left behind on any way out of the block — nor after the process that made it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from accel.core.env import read_launch_env
from accel.testing import _netns
from accel.testing._machine_report import Socket, _address, nodelist
from accel.testing.machines import Machines, machines_unavailable, requires_machines

PY = sys.executable


# -- the parts (no namespaces) ----------------------------------------------------------------

def test_nodelist_is_slurms_compressed_form() -> None:
    assert nodelist(["m0", "m1", "m2"]) == "m[0-2]"
    assert nodelist(["node08", "node09", "node11"]) == "node[08-09,11]"
    assert nodelist(["a", "b1"]) == "a,b1"
    assert nodelist(["x1", "y2"]) == "x1,y2"
    assert read_launch_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
                            "SLURM_JOB_NODELIST": nodelist(["m0", "m1"])}).master_addr == "m0"


def test_socket_addresses_are_read_from_the_kernel_tables() -> None:
    assert _address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _address("0000000000000000FFFF00000B0012C6:0050") == ("198.18.0.11", 80)
    assert _address("00000000000000000000000001000000:0016") == ("::1", 22)
    assert Socket(("127.0.0.1", 1), ("0.0.0.0", 0), "LISTEN").loopback
    assert not Socket(("198.18.0.10", 1), ("198.18.0.11", 2), "ESTABLISHED").loopback


def test_names_carry_their_owner_and_only_dead_owners_are_stale() -> None:
    tag = _netns.bed_tag(3)
    assert tag == f"{os.getpid():x}g3"
    assert _netns.owner_alive(f"axm{tag}-m0")
    assert _netns.owner_alive("eth0")  # not ours: never touched
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    assert not _netns.owner_alive(f"axm{int(dead.stdout):x}g0-m0")


def test_bad_arguments_and_unavailable_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="count=0 machines"):
        Machines(0)
    with pytest.raises(ValueError, match="2 distinct names"):
        Machines(2, hostnames=["a", "a"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert machines_unavailable() == "namespaced machines need root (this process runs as uid 1000)"
    with pytest.raises(RuntimeError, match="need root"):
        Machines(2).open()


# -- real machines ------------------------------------------------------------------------------

def _host_state(tag: str) -> list[str]:
    """Everything on the host named after bed ``tag``: netns, links, mounts, folders."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    mounts = Path("/proc/mounts").read_text()
    found = [f"netns {line}" for line in names.splitlines() if tag in line]
    found += [f"link {line}" for line in links.splitlines() if tag in line]
    found += [f"mount {line}" for line in mounts.splitlines() if tag in line]
    found += [f"folder {p}" for p in Path("/tmp").glob(f"axm{tag}*")]
    return found


def _alive(pids: list[int]) -> list[int]:
    """The pids still running (zombies count as gone: their parent reaps them)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


@pytest.mark.ci_extra
@requires_machines()
@pytest.mark.parametrize("how", ["normal", "exception", "interrupt", "timeout"])
def test_nothing_is_left_on_any_way_out(how: str) -> None:
    pids: list[int] = []
    bed = Machines(2)
    tag = bed.tag
    expected: dict[str, tuple[type[BaseException], str | None]] = {
        "exception": (ValueError, "boom"),
        "interrupt": (KeyboardInterrupt, None),
        "timeout": (TimeoutError, r"1 of 2 commands still ran after 0.5 s \('sleep 600' on m0\)"),
    }
    kind, match = expected.get(how, (_NoError, None))
    with pytest.raises(kind, match=match):
        _use_and_leave(bed, how, pids)
    assert _host_state(tag) == []
    assert bed.leftovers() == []
    assert _alive(pids) == []
    with pytest.raises(RuntimeError, match="not running"):
        bed.start(0, ["true"])


def _use_and_leave(bed: Machines, how: str, pids: list[int]) -> None:
    with bed:
        # a command, and a grandchild that escapes into a session of its own
        bed.start(0, ["sleep", "600"])
        bed.run(1, ["sh", "-c", "setsid sleep 600 > /dev/null 2>&1 &"])
        (bed.disk(1) / "f").write_text("x")
        time.sleep(0.1)
        pids += bed.processes(0) + bed.processes(1) + [h.pid for h in bed._holders]
        assert len(pids) == 4
        assert _host_state(bed.tag)
        if how == "exception":
            raise ValueError("boom")
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "timeout":
            bed.wait(timeout=0.5)
        raise _NoError


class _NoError(Exception):
    """Raised at the end of the normal way out, so every case leaves through pytest.raises."""


_KILLED_OWNER = textwrap.dedent("""
    import sys, time
    from accel.testing.machines import Machines
    bed = Machines(2)
    bed.open()
    bed.start(0, ["sleep", "600"])
    bed.start(1, ["sh", "-c", "setsid sleep 600 & wait"])
    time.sleep(0.2)
    print(bed.tag, *bed.processes(0), *bed.processes(1), *[h.pid for h in bed._holders],
          flush=True)
    time.sleep(600)
""")


@pytest.mark.ci_extra
@requires_machines()
def test_a_killed_owners_leftovers_are_removed_by_the_next_bed() -> None:
    owner = subprocess.Popen([PY, "-c", _KILLED_OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    assert owner.stdout is not None
    tag, *pid_text = owner.stdout.readline().split()
    pids = [int(p) for p in pid_text]
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    time.sleep(0.3)
    left = _host_state(tag)
    assert any(item.startswith("netns") for item in left)  # the namespaces outlive it
    # the holders die with their parent (death signal); the commands' processes may not
    with Machines(1) as bed:
        assert _host_state(tag) == []
        assert _alive(pids) == []
        assert bed.leftovers() != []  # its own parts, while open
    assert _host_state(tag) == []


_PROBE = textwrap.dedent("""
    import json, os, socket
    out = {"hostname": socket.gethostname(), "hosts": open("/etc/hosts").read()}
    for what, call in [("bind", lambda s: s.bind(("127.0.0.1", 0))),
                       ("connect", lambda s: s.connect(("127.0.0.1", 22))),
                       ("localhost", lambda s: s.connect(("localhost", 22)))]:
        s = socket.socket()
        try:
            call(s)
            out[what] = "ok"
        except OSError as exc:
            out[what] = exc.errno
        s.close()
    disk = os.environ["DISK"]
    open(os.path.join(disk, socket.gethostname()), "w").write("mine")
    out["disk"] = sorted(os.listdir(disk))
    print(json.dumps(out))
""")

_ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.bind(("0.0.0.0", 7000)); s.listen()
    print("listening", flush=True)
    while True:
        c, _ = s.accept(); c.sendall(c.recv(100)); c.close()
""")

_CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        c = socket.create_connection(("m1", 7000), timeout=2); c.sendall(b"hi")
        print(c.recv(100).decode())
    except OSError as exc:
        print(type(exc).__name__)
""")


@pytest.mark.ci_extra
@requires_machines()
def test_each_machine_has_its_name_disk_and_address_and_no_loopback(tmp_path: Path) -> None:
    import errno

    with Machines(2, shared=tmp_path) as bed:
        env = {**os.environ, "DISK": str(bed.disk_path)}
        probes = [json.loads(bed.run(k, [PY, "-c", _PROBE], env=env).stdout) for k in (0, 1)]
        for k, probe in enumerate(probes):
            assert probe["hostname"] == f"m{k}"
            assert f"{bed.address(0)} m0\n{bed.address(1)} m1\n" in probe["hosts"]
            assert probe["disk"] == [f"m{k}"]  # its own disk only
            assert probe["bind"] == errno.EADDRNOTAVAIL
            assert probe["connect"] == errno.ENETUNREACH
            assert probe["localhost"] == errno.ENETUNREACH
        assert (bed.disk(1) / "m1").read_text() == "mine"
        assert not (bed.disk(0) / "m1").exists()
        server = bed.start(1, [PY, "-c", _ECHO_SERVER])
        while "listening" not in server.stdout:
            time.sleep(0.05)
        assert bed.run(0, [PY, "-c", _CLIENT]).stdout.strip() == "hi"
        [listening] = [s for s in bed.sockets(1) if s.state == "LISTEN"]
        assert listening.local == ("0.0.0.0", 7000) and not listening.loopback
        bed.cut(1)
        assert bed.run(0, [PY, "-c", _CLIENT]).stdout.strip() in ("TimeoutError", "timeout")
        bed.restore(1)
        assert bed.run(0, [PY, "-c", _CLIENT]).stdout.strip() == "hi"
        assert bed.kill(1) == [server.pid]
        assert server.wait(5) == -signal.SIGKILL and bed.processes(1) == []
        assert (bed.disk(1) / "m1").exists()  # a machine's disk outlives its processes
        bed.copy_disk(1, tmp_path / "m1disk")
    assert (tmp_path / "m1disk" / "m1").read_text() == "mine"


_SLURM = "import json; from accel.core.env import read_launch_env as r; " \
         "e = r(); print(json.dumps([e.launcher, e.rank, e.local_rank, e.node_rank, " \
         "e.world_size, e.num_nodes, e.master_addr]))"


@pytest.mark.ci_extra
@requires_machines()
def test_srun_sets_slurms_variables_on_every_machine(tmp_path: Path) -> None:
    with Machines(2, collect_to=tmp_path / "out") as bed:
        runs = bed.srun([PY, "-c", _SLURM], tasks_per_node=2)
        bed.wait(timeout=60)
        seen = [json.loads(r.stdout) for r in runs]
    assert seen == [["slurm", rank, rank % 2, rank // 2, 4, 2, "m0"] for rank in range(4)]
    assert sorted(p.name for p in (tmp_path / "out" / "m1").iterdir()) == [
        "0.err", "0.out", "1.err", "1.out", "disk"]

"""Network namespaces for :mod:`accel.testing.machines`: the ``ip`` calls, the processes of a
namespace, the holder process that keeps a machine's hostname and disk, and the removal of
what a killed test run left behind.

Every name this module creates starts with :data:`PREFIX` followed by the owning process's
id in hex and ``g`` (``axm1a2bg0-m1``: pid 0x1a2b, its bed 0, machine 1), so that leftovers of
a process that no longer runs are recognised and removed, and those of a live one never are.
Names: ``axm<tag>-m<k>`` (namespace), ``axm<tag>-v<k>`` (the host end of its link),
``axm<tag>-br`` (the bridge), ``/tmp/axm<tag>-bed`` (the folder), with ``<tag>`` the owner's
pid in hex, ``g``, and the number of the bed in that process.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from accel.errors import MachineBedError

__all__ = [
    "PREFIX",
    "TOOLS",
    "Holder",
    "bed_folder",
    "bed_tag",
    "ip",
    "kill_all",
    "namespace_id",
    "owner_alive",
    "processes_in",
    "remove_stale",
    "set_death_signal",
    "start_time",
]

PREFIX = "axm"
TOOLS = ("ip", "unshare", "nsenter")
_NAME = re.compile(PREFIX + r"([0-9a-f]+)g([0-9a-f]+)-")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SETUP_S = 20.0


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its stdout. A failure raises ``RuntimeError`` with ip's message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False,
                          timeout=30)
    if check and done.returncode != 0:
        raise MachineBedError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def bed_tag(serial: int) -> str:
    """The name part shared by everything of this process's bed number ``serial``."""
    return f"{os.getpid():x}g{serial % 256:x}"


def owner_alive(name: str) -> bool:
    """Whether the process that created the namespace/link/folder ``name`` still runs.

    A bed's folder records its owner's start time, so a reused pid is not taken for the owner.
    Names not made by this module count as alive (never touched).
    """
    match = _NAME.match(name)
    if match is None:
        return True
    pid = int(match.group(1), 16)
    started = start_time(pid)
    if started is None:
        return False
    record = Path(tempfile.gettempdir()) / f"{match.group(0)}bed" / "owner"
    try:
        return record.read_text().split() == [str(pid), started]
    except OSError:  # no record (yet): the pid alone decides
        return True


def bed_folder(tag: str) -> Path:
    """The host folder of bed ``tag`` (hosts file, logs, owner record, disk mount point)."""
    return Path(tempfile.gettempdir()) / f"{PREFIX}{tag}-bed"


def namespace_id(netns: str) -> tuple[int, int] | None:
    """(device, inode) of the network namespace ``netns``, None if it does not exist."""
    try:
        st = os.stat(f"/run/netns/{netns}")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def processes_in(netns_ids: Iterable[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Every live process whose network namespace is one of ``netns_ids``: pid -> its id."""
    wanted = set(netns_ids)
    found: dict[int, tuple[int, int]] = {}
    if not wanted:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # gone, or a zombie (no namespaces any more)
            continue
        if (st.st_dev, st.st_ino) in wanted:
            found[int(entry)] = (st.st_dev, st.st_ino)
    return found


def kill_all(netns_ids: Iterable[tuple[int, int]], *, spare: Sequence[int] = (),
             signum: int = signal.SIGKILL, timeout: float = 10.0) -> list[int]:
    """Send ``signum`` to every process in the namespaces until none is left (but ``spare``).

    Processes that fork while being killed are caught by the next pass. Returns the pids
    signalled. With a signal other than SIGKILL one pass is made and nothing is waited for.
    """
    ids = list(netns_ids)
    signalled: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        targets = [pid for pid in processes_in(ids) if pid not in spare]
        if not targets or (signalled and signum != signal.SIGKILL):
            return signalled
        for pid in targets:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                continue
            if pid not in signalled:
                signalled.append(pid)
        if signum != signal.SIGKILL:
            return signalled
        if time.monotonic() > deadline:
            raise MachineBedError(f"processes {targets} survived SIGKILL for {timeout:.0f} s")
        time.sleep(0.02)


def set_death_signal() -> None:
    """In a child before exec: SIGKILL it when the parent dies (kept across exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


_HOLDER_SCRIPT = (
    'set -e; hostname "$1"; mount -t tmpfs -o size="$4",mode=0755 accel-machine-disk "$2"; '
    'mount --bind "$3" /etc/hosts; echo ready; exec sleep 2147483647'
)


class Holder:
    """A process in a machine's namespaces that keeps its hostname, /etc/hosts and disk.

    It runs ``sleep`` in the machine's network namespace, in a mount and UTS namespace of
    its own (private propagation: nothing it mounts is seen by the host). Commands join it
    with ``nsenter``; the host reads the disk through ``/proc/<pid>/root``.
    """

    def __init__(self, netns: str, hostname: str, disk: Path, hosts: Path, size: str) -> None:
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation",
             "private", "--", "sh", "-c", _HOLDER_SCRIPT, "sh", hostname, str(disk),
             str(hosts), size],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=set_death_signal,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], _SETUP_S)
        line = self.process.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.process.kill()
            _, err = self.process.communicate()
            raise MachineBedError(f"machine {hostname!r} could not be set up "
                               f"({netns}): {err.decode(errors='replace').strip()}")
        self.process.stdout.close()
        assert self.process.stderr is not None
        self.process.stderr.close()

    @property
    def pid(self) -> int:
        """The holder's process id (``nsenter --target``)."""
        return self.process.pid

    def enter(self, command: Sequence[str], cwd: Path) -> list[str]:
        """``command`` run inside the machine, in ``cwd``."""
        return ["nsenter", f"--target={self.pid}", "--mount", "--uts", "--net",
                f"--wd={cwd}", "--", *command]

    def reap(self) -> None:
        """Collect the holder's exit (it is killed with the machine's other processes)."""
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _names(listing: str) -> list[str]:
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Remove the namespaces, links, processes and folders of beds whose owner is gone.

    Returns what was removed (for a log line).
    """
    removed: list[str] = []
    netns = [n for n in _names(ip("netns", "list", check=False)) if n.startswith(PREFIX)]
    stale = [n for n in netns if not owner_alive(n)]
    ids = [i for i in map(namespace_id, stale) if i is not None]
    for pid in kill_all(ids):
        removed.append(f"process {pid}")
    links = [line.split(":")[1].strip().split("@")[0]
             for line in ip("-o", "link", "show", check=False).splitlines() if ":" in line]
    stale_links = [link for link in links if link.startswith(PREFIX) and not owner_alive(link)]
    for link in sorted(stale_links, key=lambda name: name.endswith("-br")):  # bridges last
        ip("link", "del", link, check=False)
        removed.append(f"link {link}")
    for name in stale:
        ip("netns", "del", name, check=False)
        removed.append(f"netns {name}")
    for folder in Path(tempfile.gettempdir()).glob(PREFIX + "*-bed"):
        if folder.is_dir() and _NAME.match(folder.name) and not owner_alive(folder.name):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(f"folder {folder}")
    return removed

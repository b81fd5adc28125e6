"""Many machines on one Linux host, for testing multi-machine jobs: network namespaces.

Each machine of a :class:`Machines` bed has its own network namespace with one address on a
bridge shared by the bed, its own hostname, its own ``/etc/hosts`` naming every machine of the
bed, and its own local disk (a tmpfs at the same path on every machine, :attr:`Machines.disk_path`).
Every other path of the host is shared by all machines (like a network file system): the
``shared`` folder for checkpoints, and the code and interpreter.

Loopback is unusable inside a machine: ``lo`` is up but holds neither 127.0.0.1 nor ::1, so
anything that binds or connects to localhost fails at once (``Cannot assign requested
address`` / ``Network is unreachable``) instead of quietly working as it never would between
real machines. A job that passes on the bed talks over the machines' own addresses only.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and the ``ip``, ``unshare`` and ``nsenter``
tools; :func:`machines_unavailable` says why a bed cannot be made, and
:func:`requires_machines` skips a pytest test then. Everything a bed made (namespaces, links,
the bridge, mounts, processes, its folder) is removed when the ``with`` block ends, on every
path out of it; a test process killed without that chance leaves things that the next bed
made on the host removes (they carry its pid).

Example:
    >>> from accel.testing.machines import Machines
    >>> with Machines(2, shared=tmp_path) as bed:
    ...     runs = bed.accel_launch(["train.py"], nproc_per_node=1, cwd=tmp_path)
    ...     bed.wait(timeout=120)
    ...     [run.returncode for run in runs], bed.hostname(1)
    ([0, 0], 'm1')
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import attrs

from accel.core.env import environ_snapshot
from accel.errors import ConfigError, MachineBedError, MachineBedTimeoutError
from accel.testing import _netns
from accel.testing._machine_report import Socket, nodelist, sockets_of
from accel.testing._script_result import tail

if TYPE_CHECKING:
    import pytest

__all__ = ["Machine", "MachineRun", "Machines", "Socket", "machines_unavailable",
           "requires_machines"]

_MAX_MACHINES = 16
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_",
                       "GROUP_", "ROLE_", "TORCHELASTIC_", "PET_", "SLURM_", "OMPI_", "PMI_")
_serial = [0]  # beds made by this process: part of their names


def machines_unavailable() -> str | None:
    """Why namespaced machines cannot be made here, or ``None`` when they can.

    Tries once: a network namespace is created and removed.

    Example:
        >>> machines_unavailable()  # as root with iproute2
        >>> machines_unavailable()  # as a user
        'namespaced machines need root (this process runs as uid 1000)'
    """
    if not sys.platform.startswith("linux"):
        return f"namespaced machines need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"namespaced machines need root (this process runs as uid {os.geteuid()})"
    missing = [tool for tool in _netns.TOOLS if shutil.which(tool) is None]
    if missing:
        return f"namespaced machines need {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{_netns.PREFIX}{os.getpid():x}g-probe"
    try:
        _netns.ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"network namespaces cannot be made here: {exc}"
    _netns.ip("netns", "del", probe, check=False)
    return None


def requires_machines() -> pytest.MarkDecorator:
    """A pytest mark skipping the test, with the reason, where machines cannot be made.

    Example:
        >>> pytestmark = requires_machines()
    """
    import pytest

    reason = machines_unavailable()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


@attrs.frozen
class Machine:
    """One machine of a bed: its index, hostname, address and the names of its parts."""

    index: int
    hostname: str
    address: str
    netns: str
    link: str
    """The host end of its link on the bridge (``ip link set LINK down`` cuts it)."""


class MachineRun:
    """A command running on one machine: its process, exit code and output.

    Output goes to files (no pipe to drain); :attr:`stdout` and :attr:`stderr` read them at
    any time, and keep what they hold once the bed is closed.
    """

    def __init__(self, machine: Machine, command: Sequence[str], process: subprocess.Popen[bytes],
                 out: Path, err: Path) -> None:
        self.machine = machine
        self.command = tuple(command)
        self.process = process
        self._files = (out, err)
        self._kept: tuple[str, str] | None = None

    @property
    def pid(self) -> int:
        """The command's process id (in the host's pid namespace)."""
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """Its exit code; ``-N`` when signal N ended it; ``None`` while it runs."""
        return self.process.poll()

    @property
    def stdout(self) -> str:
        """What it wrote to stdout so far."""
        return self._kept[0] if self._kept else _read(self._files[0])

    @property
    def stderr(self) -> str:
        """What it wrote to stderr so far."""
        return self._kept[1] if self._kept else _read(self._files[1])

    @property
    def output(self) -> str:
        """stdout then stderr."""
        return self.stdout + self.stderr

    def wait(self, timeout: float | None = None) -> int:
        """Wait until it ends; its exit code. After ``timeout`` s: ``TimeoutError``, nothing
        killed."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise MachineBedTimeoutError(
                f"{self.describe()} still runs after {timeout} s; last output:\n"
                f"{tail(self.output)}"
            ) from None

    def describe(self) -> str:
        """``'python train.py' on m1``."""
        return f"{' '.join(self.command)!r} on {self.machine.hostname}"

    def keep(self) -> None:
        """Read its output into memory (before the bed's folder goes)."""
        if self._kept is None:
            self._kept = (_read(self._files[0]), _read(self._files[1]))

    def __repr__(self) -> str:
        return f"MachineRun({self.describe()}, returncode={self.returncode})"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class Machines:
    """``count`` machines as network namespaces on this host; a context manager.

    Args:
        count: how many machines (1..16).
        shared: a host folder every machine sees at the same path (default: one inside
            the bed's folder, removed with it). Any host path is in fact visible to all.
        hostnames: the machines' names (default ``m0``, ``m1``, ...).
        disk_size: the size of each machine's tmpfs disk (``mount -o size=``).
        collect_to: when given, each machine's disk and its commands' output are copied
            into ``collect_to/<hostname>/`` when the bed closes (``disk/``, ``<n>.out``...).

    Raises:
        RuntimeError: the machines cannot be made (see :func:`machines_unavailable`).

    Example:
        >>> with Machines(2) as bed:
        ...     run = bed.run(1, ["hostname"])
        ...     run.stdout
        'm1\\n'
    """

    def __init__(self, count: int, *, shared: str | os.PathLike[str] | None = None,
                 hostnames: Sequence[str] | None = None, disk_size: str = "512m",
                 collect_to: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(count, int) or not 1 <= count <= _MAX_MACHINES:
            raise ConfigError(f"count={count!r} machines: give 1..{_MAX_MACHINES}.")
        names = list(hostnames) if hostnames is not None else [f"m{k}" for k in range(count)]
        if len(names) != count or len(set(names)) != count:
            raise ConfigError(f"hostnames={names!r}: give {count} distinct names.")
        self._serial = _serial[0]
        _serial[0] += 1
        self.tag = _netns.bed_tag(self._serial)
        subnet = (os.getpid() * 7 + self._serial) % 512
        self._network = f"198.{18 + subnet // 256}.{subnet % 256}"
        self.machines = [
            Machine(k, name, f"{self._network}.{10 + k}", f"{_netns.PREFIX}{self.tag}-m{k:x}",
                    f"{_netns.PREFIX}{self.tag}-v{k:x}")
            for k, name in enumerate(names)
        ]
        self.bridge = f"{_netns.PREFIX}{self.tag}-br"
        self.root = _netns.bed_folder(self.tag)
        self.disk_path = self.root / "disk"
        self.shared = Path(shared) if shared is not None else self.root / "shared"
        self._disk_size = disk_size
        self._collect_to = Path(collect_to) if collect_to is not None else None
        self._holders: list[_netns.Holder] = []
        self._ids: list[tuple[int, int]] = []
        self.runs: list[MachineRun] = []
        self._open = False

    # -- life -----------------------------------------------------------------------------

    def __enter__(self) -> Machines:
        self.open()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        """Make the machines (``with`` does it); first removes what dead beds left."""
        reason = machines_unavailable()
        if reason is not None:
            raise MachineBedError(f"Cannot make namespaced machines: {reason}.")
        _netns.remove_stale()
        self._open = True
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        self.root.mkdir(mode=0o755)
        pid = os.getpid()
        (self.root / "owner").write_text(f"{pid} {_netns.start_time(pid)}\n")
        (self.root / "logs").mkdir()
        self.disk_path.mkdir()
        self.shared.mkdir(parents=True, exist_ok=True)
        hosts = self.root / "hosts"
        hosts.write_text("127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{m.address} {m.hostname}\n" for m in self.machines))
        _netns.ip("link", "add", self.bridge, "type", "bridge")
        _netns.ip("link", "set", self.bridge, "up")
        for m in self.machines:
            _netns.ip("netns", "add", m.netns)
            ns_id = _netns.namespace_id(m.netns)
            assert ns_id is not None
            self._ids.append(ns_id)
            _netns.ip("link", "add", m.link, "type", "veth", "peer", "name", "eth0",
                      "netns", m.netns)
            _netns.ip("link", "set", m.link, "master", self.bridge, "up")
            _netns.ip("-n", m.netns, "addr", "add", f"{m.address}/24", "dev", "eth0")
            _netns.ip("-n", m.netns, "link", "set", "eth0", "up")
            _netns.ip("-n", m.netns, "link", "set", "lo", "up")  # own address needs lo up
            _netns.ip("-n", m.netns, "addr", "del", "127.0.0.1/8", "dev", "lo")
            _netns.ip("-n", m.netns, "addr", "del", "::1/128", "dev", "lo", check=False)
            self._holders.append(
                _netns.Holder(m.netns, m.hostname, self.disk_path, hosts, self._disk_size))

    def close(self) -> None:
        """Stop every process of every machine and remove all the bed made (idempotent).

        Raises:
            RuntimeError: something could not be removed (named).
        """
        if not self._open:
            return
        try:
            _netns.kill_all(self._ids, spare=[h.pid for h in self._holders])
            for run in self.runs:
                run.process.wait()
            if self._collect_to is not None:
                self._collect()
            for run in self.runs:
                run.keep()
        finally:
            self._open = False
            _netns.kill_all(self._ids)
            for holder in self._holders:
                holder.reap()
            for m in self.machines:
                _netns.ip("link", "del", m.link, check=False)
                _netns.ip("netns", "del", m.netns, check=False)
            _netns.ip("link", "del", self.bridge, check=False)
            shutil.rmtree(self.root, ignore_errors=True)
        left = self.leftovers()
        if left:
            raise MachineBedError(f"The machines' bed {self.tag} left behind: {'; '.join(left)}.")

    def leftovers(self) -> list[str]:
        """What of this bed exists on the host: namespaces, links, processes, mounts, folder."""
        mine = f"{_netns.PREFIX}{self.tag}-"
        found = [f"netns {n}" for n in _netns.ip("netns", "list", check=False).split()
                 if n.startswith(mine)]
        found += [f"link {line.split(':')[1].strip().split('@')[0]}"
                  for line in _netns.ip("-o", "link", "show", check=False).splitlines()
                  if ":" in line and line.split(":")[1].strip().startswith(mine)]
        found += [f"process {pid}" for pid in _netns.processes_in(self._ids)]
        found += [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text()
                  .splitlines() if mine in line or str(self.root) in line]
        if self.root.exists():
            found.append(f"folder {self.root}")
        return found

    def _collect(self) -> None:
        assert self._collect_to is not None
        for k, m in enumerate(self.machines):
            dest = self._collect_to / m.hostname
            dest.mkdir(parents=True, exist_ok=True)
            self.copy_disk(k, dest / "disk")
            for n, run in enumerate(r for r in self.runs if r.machine is m):
                (dest / f"{n}.out").write_text(run.stdout)
                (dest / f"{n}.err").write_text(run.stderr)

    # -- facts ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.machines)

    def hostname(self, k: int) -> str:
        """Machine ``k``'s hostname (resolvable on every machine of the bed)."""
        return self.machines[k].hostname

    def address(self, k: int) -> str:
        """Machine ``k``'s IPv4 address."""
        return self.machines[k].address

    def disk(self, k: int) -> Path:
        """Machine ``k``'s local disk as a host path (valid while the bed is open).

        On the machine itself the disk is at :attr:`disk_path`.
        """
        self._check_open()
        return Path(f"/proc/{self._holders[k].pid}/root") / self.disk_path.relative_to("/")

    def copy_disk(self, k: int, dest: str | os.PathLike[str]) -> Path:
        """Copy machine ``k``'s local disk into the host folder ``dest``; ``dest``."""
        shutil.copytree(self.disk(k), dest, dirs_exist_ok=True, symlinks=True)
        return Path(dest)

    def processes(self, k: int) -> list[int]:
        """The pids of every process running on machine ``k`` (its commands and theirs)."""
        self._check_open()
        holder = self._holders[k].pid
        return sorted(p for p in _netns.processes_in([self._ids[k]]) if p != holder)

    def sockets(self, k: int) -> list[Socket]:
        """The TCP sockets open on machine ``k`` now (listening and connected)."""
        self._check_open()
        return sockets_of(self._holders[k].pid)

    # -- commands -------------------------------------------------------------------------

    def start(self, k: int, command: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None) -> MachineRun:
        """Start ``command`` on machine ``k``; it runs until it ends or the bed closes.

        Args:
            k: the machine's index.
            command: the program and its arguments (no shell).
            env: its whole environment (default: this process's).
            cwd: its working directory (default: the shared folder).

        Example:
            >>> run = bed.start(0, ["python", "train.py"], cwd=tmp_path)
            >>> run.wait(timeout=60)
            0
        """
        self._check_open()
        machine = self.machines[k]
        n = sum(1 for r in self.runs if r.machine is machine)
        out = self.root / "logs" / f"{machine.hostname}.{n}.out"
        err = out.with_suffix(".err")
        where = Path(cwd) if cwd is not None else self.shared
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(
                self._holders[k].enter(list(command), where),
                env=dict(env) if env is not None else environ_snapshot(),
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                start_new_session=True, preexec_fn=_netns.set_death_signal,
            )
        run = MachineRun(machine, command, process, out, err)
        self.runs.append(run)
        return run

    def run(self, k: int, command: Sequence[str], *, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None, timeout: float = 120) -> MachineRun:
        """:meth:`start` and wait for it (``TimeoutError`` after ``timeout``, then killed)."""
        run = self.start(k, command, env=env, cwd=cwd)
        try:
            run.wait(timeout)
        except TimeoutError:
            run.process.kill()
            run.process.wait()
            raise
        return run

    def wait(self, runs: Iterable[MachineRun] | None = None, *, timeout: float) -> list[MachineRun]:
        """Wait until all ``runs`` (default: every command started) end; the runs.

        Raises:
            TimeoutError: some still ran after ``timeout`` s; then every process of every
                machine is killed, and the message holds each run's last output.
        """
        chosen = list(self.runs if runs is None else runs)
        deadline = time.monotonic() + timeout
        while any(r.returncode is None for r in chosen):
            if time.monotonic() > deadline:
                late = [r for r in chosen if r.returncode is None]
                self.kill_all()
                report = "\n".join(f"--- {r.describe()} (exit {r.returncode}):\n{tail(r.output)}"
                                   for r in chosen)
                raise MachineBedTimeoutError(
                                   f"{len(late)} of {len(chosen)} commands still ran after "
                                   f"{timeout} s ({', '.join(r.describe() for r in late)}); "
                                   f"all killed. Their output:\n{report}")
            time.sleep(0.05)
        return chosen

    def kill(self, k: int, signum: int = signal.SIGKILL) -> list[int]:
        """Send ``signum`` to every process on machine ``k`` (a machine that dies); the pids.

        With SIGKILL (the default) it returns once they are all gone. The machine's disk,
        address and link stay: :meth:`start` runs new commands on it.
        """
        self._check_open()
        return _netns.kill_all([self._ids[k]], spare=[self._holders[k].pid], signum=signum)

    def kill_all(self) -> None:
        """SIGKILL every process on every machine (the machines themselves stay)."""
        _netns.kill_all(self._ids, spare=[h.pid for h in self._holders])
        for run in self.runs:
            run.process.wait()

    def cut(self, k: int) -> None:
        """Cut machine ``k``'s link: its packets and those sent to it are lost, silently."""
        self._check_open()
        _netns.ip("link", "set", self.machines[k].link, "down")

    def restore(self, k: int) -> None:
        """Reconnect machine ``k``'s link after :meth:`cut`."""
        self._check_open()
        _netns.ip("link", "set", self.machines[k].link, "up")

    # -- launchers ------------------------------------------------------------------------

    def accel_launch(self, args: Sequence[str], *, nproc_per_node: int = 1,
                     options: Sequence[str] = (), port: int = 29500,
                     env: Mapping[str, str] | None = None,
                     cwd: str | os.PathLike[str] | None = None,
                     machines: Sequence[int] | None = None) -> list[MachineRun]:
        """Start ``accel launch ... ARGS`` on every machine (or those in ``machines``).

        Each gets ``--nnodes N --node-rank k --nproc-per-node P --master-addr <machine 0's
        hostname> --master-port PORT`` and ``options`` before ``args`` (the script and its
        arguments). ``env`` defaults to this process's environment without launcher variables.

        Example:
            >>> runs = bed.accel_launch(["train.py", "--epochs", "1"], nproc_per_node=2)
        """
        started = []
        for k in (range(len(self)) if machines is None else machines):
            command = [sys.executable, "-m", "accel.cli", "launch", "--nnodes", str(len(self)),
                       "--node-rank", str(k), "--nproc-per-node", str(nproc_per_node),
                       "--master-addr", self.hostname(0), "--master-port", str(port),
                       *options, *args]
            started.append(self.start(k, command, env=self._job_env(env), cwd=cwd))
        return started

    def srun(self, command: Sequence[str], *, tasks_per_node: int = 1, job_id: int = 4242,
             env: Mapping[str, str] | None = None,
             cwd: str | os.PathLike[str] | None = None) -> list[MachineRun]:
        """Start ``command`` as ``srun`` would: ``tasks_per_node`` tasks on every machine.

        Each task gets the variables SLURM sets for a step (``SLURM_PROCID``,
        ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_NTASKS``,
        ``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID``...); no launcher runs.

        Example:
            >>> runs = bed.srun([sys.executable, "train.py"], tasks_per_node=2)
        """
        started = []
        base = self._job_env(env)
        nodes = nodelist([m.hostname for m in self.machines])
        count = len(self)
        for k, m in enumerate(self.machines):
            for local in range(tasks_per_node):
                slurm = {
                    "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0",
                    "SLURM_JOB_NAME": "accel-machines", "SLURM_PROCID": str(k * tasks_per_node
                                                                            + local),
                    "SLURM_LOCALID": str(local), "SLURM_NODEID": str(k),
                    "SLURM_NNODES": str(count), "SLURM_JOB_NUM_NODES": str(count),
                    "SLURM_STEP_NUM_NODES": str(count),
                    "SLURM_NTASKS": str(count * tasks_per_node),
                    "SLURM_NPROCS": str(count * tasks_per_node),
                    "SLURM_STEP_NUM_TASKS": str(count * tasks_per_node),
                    "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
                    "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{count})",
                    "SLURM_JOB_NODELIST": nodes, "SLURM_NODELIST": nodes,
                    "SLURM_STEP_NODELIST": nodes, "SLURMD_NODENAME": m.hostname,
                }
                started.append(self.start(k, command, env={**base, **slurm}, cwd=cwd))
        return started

    def _job_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        chosen = dict(env) if env is not None else environ_snapshot()
        return {key: value for key, value in chosen.items()
                if not key.startswith(_LAUNCHER_VARIABLES)}

    def _check_open(self) -> None:
        if not self._open:
            raise MachineBedError("The machines are not running: use them inside "
                               "`with Machines(...) as bed:`.")

    def __repr__(self) -> str:
        names = ", ".join(f"{m.hostname}={m.address}" for m in self.machines)
        return f"Machines({names}{'' if self._open else ', closed'})"


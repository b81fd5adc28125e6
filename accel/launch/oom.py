"""The kernel's out-of-memory kills, counted before a job and after it fails: evidence (or its
absence) that a worker killed by SIGKILL ran out of memory.

A SIGKILL comes from the kernel's OOM killer or from another process (a scheduler, ``kill -9``);
the signal alone does not say which. The kernel counts its kills where any user can read them:
the job's memory cgroup (``oom_kill`` in ``memory.events``, cgroup v2, or in
``memory.oom_control``, cgroup v1) and the whole machine (``oom_kill`` in ``/proc/vmstat``).
:func:`read_oom_kills` reads those counters (small files, never ``dmesg``, nothing that needs
root); :func:`oom_evidence` compares two readings.

Example:
    >>> before = read_oom_kills()
    >>> ...  # the job runs, a worker is killed
    >>> evidence = oom_evidence(before, read_oom_kills())
    >>> evidence.kills if evidence else None  # doctest: +SKIP
    1
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import attrs

__all__ = ["OomCount", "OomEvidence", "oom_evidence", "read_oom_kills"]

Scope = Literal["cgroup", "machine"]

_READ_LIMIT = 64 * 1024  # the counter files are a few hundred bytes


@attrs.frozen
class OomCount:
    """One OOM-kill counter: the file it was read from, what it covers, its value.

    Example:
        >>> OomCount("/proc/vmstat", "machine", 0).count
        0
    """

    source: str
    scope: Scope
    count: int


@attrs.frozen(kw_only=True)
class OomEvidence:
    """What one counter says about the job's run: how many processes the OOM killer ended.

    ``scope`` ``"cgroup"``: kills in the job's own memory cgroup (the workers'); ``"machine"``:
    kills anywhere on the machine (read only where no cgroup counter could be).

    Example:
        >>> OomEvidence(source="/proc/vmstat", scope="machine", before=4, after=5).kills
        1
    """

    source: str
    scope: Scope
    before: int
    after: int

    @property
    def kills(self) -> int:
        """The processes the OOM killer ended between the two readings."""
        return max(0, self.after - self.before)

    def counted(self) -> str:
        """``oom_kill`` in SOURCE went from A to B (or stayed at A), for a report.

        Example:
            >>> OomEvidence(source="/proc/vmstat", scope="machine", before=4, after=4).counted()
            '`oom_kill` in /proc/vmstat stayed at 4'
        """
        if self.kills:
            return f"`oom_kill` in {self.source} went from {self.before} to {self.after}"
        return f"`oom_kill` in {self.source} stayed at {self.before}"


def _read_small(path: Path) -> str | None:
    try:
        with path.open("rb") as file:
            return file.read(_READ_LIMIT).decode("utf-8", "replace")
    except OSError:  # missing, unreadable, not a file: no counter there
        return None


def _counter(path: Path, key: str = "oom_kill") -> int | None:
    """The value of ``key`` in a ``name value`` per line file; ``None`` where it has none."""
    text = _read_small(path)
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def _cgroup_files(root: Path) -> list[Path]:
    """The counter files of this process's memory cgroup (v2, then v1), from /proc/self/cgroup."""
    files: list[Path] = []
    for line in (_read_small(root / "proc/self/cgroup") or "").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, where = rest.partition(":")
        relative = where.strip().lstrip("/")
        if number == "0" and controllers == "":
            files.append(root / "sys/fs/cgroup" / relative / "memory.events")
        elif "memory" in controllers.split(","):
            files.append(root / "sys/fs/cgroup/memory" / relative / "memory.oom_control")
    return files


def read_oom_kills(root: Path = Path("/")) -> tuple[OomCount, ...]:
    """Read the OOM-kill counters this process can see: its memory cgroup's, the machine's.

    Args:
        root: Where ``/proc`` and ``/sys`` are (a test's fake tree; ``/`` otherwise).

    Returns:
        The counters that could be read (none on a system without them, e.g. macOS).

    Example:
        >>> [count.scope for count in read_oom_kills()]  # doctest: +SKIP
        ['cgroup', 'machine']
    """
    found = []
    for path in _cgroup_files(root):
        value = _counter(path)
        if value is not None:
            found.append(OomCount(str(path), "cgroup", value))
    machine = root / "proc/vmstat"
    value = _counter(machine)
    if value is not None:
        found.append(OomCount(str(machine), "machine", value))
    return tuple(found)


def oom_evidence(before: Sequence[OomCount], after: Sequence[OomCount]) -> OomEvidence | None:
    """Compare two readings of :func:`read_oom_kills`: the job's cgroup counter where both
    readings have one (it covers the workers and nothing else), else the machine's.

    Returns:
        The evidence, ``kills`` 0 where the counter did not rise; ``None`` where no counter
        was read both times (nothing is known either way).

    Example:
        >>> oom_evidence([OomCount("/proc/vmstat", "machine", 2)],
        ...              [OomCount("/proc/vmstat", "machine", 3)]).kills
        1
    """
    later = {(count.source, count.scope): count.count for count in after}
    pairs = [(count, later[(count.source, count.scope)]) for count in before
             if (count.source, count.scope) in later]
    for scope in ("cgroup", "machine"):
        chosen = [(count, now) for count, now in pairs if count.scope == scope]
        if chosen:
            rose = [(count, now) for count, now in chosen if now > count.count]
            count, now = (rose or chosen)[0]
            return OomEvidence(source=count.source, scope=count.scope, before=count.count,
                               after=now)
    return None

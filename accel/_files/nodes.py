"""Who writes checkpoints: rank 0, or each machine's local main process (``on_each_node``).

By default one copy is written, by the global main process, to a filesystem every machine
sees. With ``on_each_node=True`` (machines with local disks only, as Accelerate's
``save_on_each_node``) every machine's local main process (``local_rank == 0``) writes its
own copy, and the ranks of a machine form one *group*, keyed by ``node_rank``. ``save_state``
and ``load_state`` exchange what each group's writer found with one ``gather_object`` that
every rank calls, and decide from the same gathered list on every rank.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from accel.core.state import state
from accel.errors import CheckpointArgumentError, CheckpointError

__all__ = ["agree_candidates", "group_of", "resolve", "settle_start", "writes"]

_NUMBERED = re.compile(r"^\.?(checkpoint_[0-9]+)(?:\.old-[0-9a-f]+)?\Z")


def resolve(on_each_node: object, op: str) -> bool:
    """``on_each_node`` as given, or the default of the active ``distributed()`` block.

    Raises:
        CheckpointArgumentError: not ``True``, ``False`` or ``None``.
    """
    if on_each_node is None:
        return state().on_each_node
    if isinstance(on_each_node, bool):
        return on_each_node
    raise CheckpointArgumentError(
        f"accel.{op}(on_each_node={on_each_node!r}) must be True, False or None (None: the "
        "default of `accel.distributed(on_each_node=...)`, the config key `on_each_node` or "
        "ACCEL_ON_EACH_NODE). Pass True when the machines have no shared filesystem."
    )


def writes(each: bool) -> bool:
    """Whether this process writes: the local main process per machine, else rank 0."""
    st = state()
    return st.is_local_main_process if each else st.is_main_process


def group_of(each: bool) -> int:
    """The group this rank's files go to: its machine with ``each``, else the one group 0."""
    return state().node_rank if each else 0


def _writers(groups: Sequence[tuple[int, bool]]) -> tuple[dict[int, int], list[str]]:
    """Each group's writer rank, and a problem for each group without exactly one."""
    members: dict[int, list[int]] = {}
    writers: dict[int, list[int]] = {}
    for rank, (group, is_writer) in enumerate(groups):
        members.setdefault(group, []).append(rank)
        if is_writer:
            writers.setdefault(group, []).append(rank)
    problems = [
        f"machine node_rank={group} (ranks {ranks}) has {len(writers.get(group, []))} local "
        f"main processes ({writers.get(group, [])}); on_each_node=True needs exactly one "
        "(local_rank 0) per machine. Check the launcher's LOCAL_RANK and GROUP_RANK/NODE_RANK."
        for group, ranks in sorted(members.items())
        if len(writers.get(group, [])) != 1
    ]
    return {g: w[0] for g, w in writers.items() if len(w) == 1}, problems


def settle_start(
    entries: Sequence[tuple[int, bool, str | None, str | None, str | None]], group: int
) -> tuple[list[str], str | None, str]:
    """From every rank's ``(group, writes, temporary name, problem, save id)``: the problems
    (each once), the temporary directory name of this rank's group, and rank 0's save id."""
    writers, problems = _writers([(g, w) for g, w, _, _, _ in entries])
    several = len(writers) > 1
    for rank, (_, _, _, problem, _) in enumerate(entries):
        if problem is not None:
            problems.append(f"rank {rank}: {problem}" if several else problem)
    problems = list(dict.fromkeys(problems))
    writer = writers.get(group)
    name = entries[writer][2] if writer is not None else None
    return problems, name, entries[0][4] or ""


def _key(path: str, explicit: bool) -> str:
    match = _NUMBERED.match(os.path.basename(path))
    return "." if explicit or match is None else match.group(1)


def agree_candidates(
    entries: Sequence[tuple[int, bool, list[str], bool]], group: int
) -> tuple[list[str], bool, list[str]]:
    """The checkpoints every machine holds, newest first, as this rank's group sees them.

    ``entries`` holds every rank's ``(group, writes, candidate paths, explicit)``. Returns
    this rank's paths of the checkpoints found in every group, whether they are explicit
    checkpoint directories (no fallback), and a note for each checkpoint only some machines
    hold (skipped).

    Raises:
        CheckpointError: on every rank alike, when a group has no writer or several.
    """
    writers, problems = _writers([(g, w) for g, w, _, _ in entries])
    if problems:
        raise CheckpointError("; ".join(problems))
    found = {g: entries[w] for g, w in writers.items()}
    if len(found) == 1:
        (_, _, paths, explicit), = found.values()
        return list(paths), explicit, []
    keyed = {g: {_key(p, e[3]): p for p in e[2]} for g, e in found.items()}
    first = next(iter(keyed.values()))
    common = [k for k in first if all(k in table for table in keyed.values())]
    partial = sorted(
        {k for table in keyed.values() for k in table} - set(common),
        key=lambda k: (len(k), k),
    )
    notes = [
        f"{k if k != '.' else 'the checkpoint'} is on machines "
        f"{sorted(g for g, t in keyed.items() if k in t)} only"
        for k in partial
    ]
    explicit_all = all(e[3] for e in found.values())
    return [keyed[group][k] for k in common], explicit_all, notes


"""Where checkpoints live and how accel recognises its own.

A checkpoint is a directory holding ``manifest.json`` (format ``accel-checkpoint``) and exactly
the files its manifest lists. Numbered checkpoints are ``ROOT/checkpoint_N``. Everything here
is pure reading: no function in this module writes or deletes.
"""

from __future__ import annotations

import operator
import os
import re
import warnings
from pathlib import Path
from typing import Any

from accel._files.atomic import leftovers
from accel._files.paths import as_path
from accel._files.safe_io import MAX_JSON_BYTES, load_json, read_bounded
from accel.errors import CheckpointArgumentError, CheckpointError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "candidates",
    "check_step",
    "foreign_entries",
    "is_complete",
    "latest_checkpoint",
    "lock_path",
    "manifest_problem",
    "read_manifest",
]

MANIFEST = "manifest.json"
FORMAT = "accel-checkpoint"
ROOT_LOCK = ".accel-checkpoints.lock"
_STEP_DIR = re.compile(r"^checkpoint_([0-9]+)\Z")  # ASCII digits, no "\n" at the end
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # fullmatch: no "\n" at the end
_RANK_FILE = "rng_rank0.json"  # every save_state writes it: its presence marks a checkpoint
_SHOWN = 10  # skipped checkpoints named in one warning; the others are counted


def check_step(step: object) -> int | None:
    """``step`` as an ``int >= 0`` (numpy and torch integers accepted), or ``None``.

    Raises:
        CheckpointError: a bool, float, string, negative number or anything not an integer.
    """
    if step is None:
        return None
    try:
        value = None if isinstance(step, bool) else operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or value < 0:
        raise CheckpointArgumentError(
            f"save_state(step={step!r}): step must be an int >= 0 (it names the directory "
            "`checkpoint_<step>` that `latest_checkpoint` orders by), e.g. `step=1200`. "
            "Convert it with `int(...)`, or leave step out to save into the directory itself."
        )
    return value


def lock_path(root: Path, numbered: bool) -> Path:
    """The lock file of one place: inside the root for numbered saves, beside a fixed one."""
    return root / ROOT_LOCK if numbered else root.with_name(f".{root.name}.accel-lock")


def _schema_error(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"The manifest {os.fspath(path / MANIFEST)!r} is invalid: {what}. The checkpoint is "
        "corrupted or was not written by accel; load an earlier checkpoint."
    )


def _check_files(path: Path, files: object) -> None:
    if not isinstance(files, list):
        raise _schema_error(path, f"'files' is {files!r:.60}, not a list")
    seen: set[str] = set()
    for entry in files:
        if not isinstance(entry, dict):
            raise _schema_error(path, f"a 'files' entry is {entry!r:.60}, not an object")
        name, size, crc, rank = (entry.get(k) for k in ("name", "size", "crc32", "rank"))
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
            raise _schema_error(
                path, f"the entry name {name!r:.80} is not a plain file name inside the directory"
            )
        for key, value in (("size", size), ("crc32", crc), ("rank", rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _schema_error(path, f"entry {name!r} has {key}={value!r:.40}")
        if name in seen or name == MANIFEST:
            raise _schema_error(path, f"the entry {name!r} is listed twice (or is the manifest)")
        seen.add(name)


def read_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of the checkpoint at ``path``.

    The file is read as untrusted input: never through a link, only a regular file, at most
    :data:`~accel._files.safe_io.MAX_JSON_BYTES`, with the strict JSON loader.

    Raises:
        CheckpointError: missing, unreadable, not accel's, or with fields of the wrong type.
    """
    try:
        raw = read_bounded(path / MANIFEST, MAX_JSON_BYTES)
    except OSError as exc:
        raise CheckpointError(
            f"{os.fspath(path / MANIFEST)!r} is missing or unreadable ({exc}): "
            f"{os.fspath(path)!r} is not a complete accel checkpoint."
        ) from None
    manifest = load_json(raw, lambda problem: _schema_error(path, problem))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{os.fspath(path / MANIFEST)!r} is not an accel checkpoint manifest."
        )
    _check_files(path, manifest.get("files"))
    objects = manifest.get("objects")
    if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
        raise _schema_error(path, f"'objects' is {objects!r:.60}, not a list of names")
    world = manifest.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise _schema_error(path, f"'world_size' is {world!r:.40}")
    step = manifest.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise _schema_error(path, f"'step' is {step!r:.40}")
    ranks = manifest.get("ranks")  # absent before on_each_node: the copy holds every rank's
    if ranks is not None and not (
        isinstance(ranks, list)
        and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in ranks)
    ):
        raise _schema_error(path, f"'ranks' is {ranks!r:.60}, not a list of ranks")
    save_id = manifest.get("save_id")
    if save_id is not None and not isinstance(save_id, str):
        raise _schema_error(path, f"'save_id' is {save_id!r:.40}")
    return manifest


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a readable accel manifest (contents are checked on load)."""
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


def manifest_problem(path: Path) -> str | None:
    """Why the manifest that ``path`` holds is refused; ``None`` when it is readable or when
    there is none (an incomplete checkpoint, e.g. a killed save, is no problem to report)."""
    if not os.path.lexists(path / MANIFEST):
        return None
    try:
        read_manifest(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def foreign_entries(path: Path) -> list[str]:
    """Entries of ``path`` that accel did not write (all of them if it is no checkpoint).

    ``[]`` for a missing or empty directory; ``[name]`` when ``path`` is not a directory.
    """
    if not os.path.lexists(path):
        return []
    if path.is_symlink() or not path.is_dir():
        return [path.name]
    entries = sorted(os.listdir(path))
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return entries
    owned = {MANIFEST} | {f["name"] for f in manifest["files"]}
    return [name for name in entries if name not in owned]


def _looks_like_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).exists() or (path / _RANK_FILE).exists()


def candidates(directory: Path) -> tuple[list[Path], bool]:
    """The checkpoints ``load_state(directory)`` may use, newest first, and whether the
    directory itself is one (then it is the only candidate: no fallback).

    A numbered checkpoint whose directory is missing but whose old copy waits aside (a
    replacement killed between its renames, where the platform cannot swap atomically)
    is found under that copy's name.
    """
    if _looks_like_checkpoint(directory):
        return [directory], True
    if not os.path.lexists(directory):
        old = [p for p in leftovers(directory, "old") if _looks_like_checkpoint(p)]
        return (old[-1:], True) if old else ([], False)
    if not directory.is_dir():
        return [], False
    found: dict[int, Path] = {}
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        if match:
            found[int(match.group(1))] = directory / name
    for name in os.listdir(directory):
        match = re.match(r"^\.(checkpoint_([0-9]+))\.old-[0-9a-f]+\Z", name)
        if match and int(match.group(2)) not in found and _looks_like_checkpoint(
            directory / name
        ):
            found[int(match.group(2))] = directory / name
    return [found[step] for step in sorted(found, reverse=True)], False


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint at ``root`` (itself, or its newest ``checkpoint_N``).

    Incomplete checkpoints (killed saves) are never returned; the contents are verified by
    :func:`accel.load_state`, which also falls back past a corrupted newest one. A checkpoint
    whose manifest is refused (corrupted or crafted) is skipped with a warning, never
    deleted; nothing is raised for it. It is a plain file-system read, not a collective:
    ranks sharing a filesystem get the same answer.

    Example:
        >>> accel.latest_checkpoint("ckpt")
        PosixPath('ckpt/checkpoint_300')
    """
    found, _ = candidates(as_path(root, "accel.latest_checkpoint", "root"))
    skipped: list[str] = []
    newest = None
    for path in found:
        problem = manifest_problem(path)  # one read each (no manifest: a killed save)
        if problem is None and os.path.lexists(path / MANIFEST):
            newest = path
            break
        if problem is not None:
            skipped.append(f"{os.fspath(path)!r}: {problem}")
    if skipped:
        more = f" (and {len(skipped) - _SHOWN} more)" if len(skipped) > _SHOWN else ""
        warnings.warn(
            f"latest_checkpoint skips {'; '.join(skipped[:_SHOWN])}{more}. They are left in "
            "place.",
            stacklevel=2,
        )
    return newest

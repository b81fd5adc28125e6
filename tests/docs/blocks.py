"""The code blocks of the Markdown pages (README.md, docs/*.md) and their doc-test markers.

A Python block (```` ```python ````) carries a marker on a line just before its fence (other
comment lines may sit between them) saying how the tests treat it::

    <!-- doc-test: python -->          run in one process, in a fresh namespace seeded with
                                       the fixtures of tests/docs/fixtures.py
    <!-- doc-test: continue -->        run in the namespace the previous block left (the
                                       page's earlier blocks define what it uses)
    <!-- doc-test: launch -->          run on 2 CPU processes as ``accel launch`` runs it
                                       (the fixtures first); a ci_extra test
    <!-- doc-test: gpu -- REASON -->   run in one process on a CUDA device; skipped (with
                                       REASON) where there is none
    <!-- doc-test: no -- REASON -->    not meant to run: a signature, output, another
                                       library's code, or a block that another test runs

``python`` and ``continue`` may add ``raises NAME`` (the block ends by raising the
``accel.errors`` error it shows) and ``ci_extra`` (heavy: run in the ci_extra step).
``gpu`` and ``no`` need a reason. A Python block without a marker fails the tests: nothing is
left out by accident.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("python", "continue", "launch", "gpu", "no")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
MARKER = re.compile(r"^\s*<!-- doc-test: (?P<spec>.*?)(?: -- (?P<reason>.*?))? -->\s*$")


@attrs.frozen
class Block:
    page: str  # the page's path from the repository root
    line: int  # the line of the opening fence (1-based)
    lang: str
    code: str  # dedented by the fence's indent
    kind: str | None = None  # None: no marker
    raises: str | None = None
    ci_extra: bool = False
    reason: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page of docs/ (the front page included)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _marker(lines: list[str], fence: int) -> re.Match[str] | None:
    """The doc-test marker among the comment lines right above line ``fence`` (0-based)."""
    i = fence - 1
    while i >= 0 and lines[i].lstrip().startswith("<!--"):
        found = MARKER.match(lines[i])
        if found:
            return found
        i -= 1
    return None


def _parse(page: str, lang: str, line: int, code: str, marker: re.Match[str] | None) -> Block:
    if marker is None:
        return Block(page, line, lang, code)
    words = marker["spec"].split()
    kind, rest = words[0], words[1:]
    if kind not in KINDS:
        raise ValueError(f"{page}:{line}: unknown doc-test kind {kind!r}; use one of {KINDS}")
    raises = None
    if "raises" in rest:
        at = rest.index("raises")
        raises = rest[at + 1]
        del rest[at:at + 2]
    ci_extra = "ci_extra" in rest
    rest = [w for w in rest if w != "ci_extra"]
    if rest:
        raise ValueError(f"{page}:{line}: unknown doc-test words {rest} in {marker[0].strip()!r}")
    if kind in ("gpu", "no") and not marker["reason"]:
        raise ValueError(f"{page}:{line}: a {kind!r} block needs a reason: "
                         f"<!-- doc-test: {kind} -- WHY -->")
    return Block(page, line, lang, code, kind, raises, ci_extra, marker["reason"])


def blocks(path: Path) -> Iterator[Block]:
    """The fenced code blocks of one page, in page order."""
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent = opened["indent"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end]]
        code = "\n".join(body) + "\n"
        yield _parse(page, opened["lang"], i + 1, code, _marker(lines, i))
        i = end + 1


def all_blocks() -> list[Block]:
    return [block for path in pages() for block in blocks(path)]


def call_tests(ns: dict[str, Any], tmp: Path) -> None:
    """Call the ``test_*`` functions a block defined (a test file shown on a page), each
    with a fresh ``tmp_path`` under ``tmp`` when it takes one."""
    for name, fn in list(ns.items()):
        if name.startswith("test_") and inspect.isfunction(fn):
            params = inspect.signature(fn).parameters
            fn(**({"tmp_path": tmp / name} if "tmp_path" in params else {}))

"""Every ``page.md#anchor`` link of README.md and docs/*.md names a heading that exists.

``mkdocs build --strict`` (.ci/run, with the docs extra) fails on a dead anchor too; this
fast check finds it in the README's test command, without mkdocs. Slugs follow Python-Markdown's
``toc`` extension: the heading's text (code spans and links reduced to their text), NFKD to
ASCII, characters other than word characters, spaces and hyphens dropped, lower case, runs of
spaces and hyphens to one hyphen; a repeated slug gets ``_1``, ``_2``; ``{#id}`` sets its own.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\((?P<target>[^)\s#]*)#(?P<anchor>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
CUSTOM_ID = re.compile(r"\s*\{[^}]*#(?P<id>[\w-]+)[^}]*\}\s*$")


def slugify(text: str) -> str:
    """Python-Markdown toc's default slug of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = text.replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The ids of the headings of ``page`` (code fences skipped)."""
    found: set[str] = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        heading = None if in_fence else HEADING.match(line)
        if heading is None:
            continue
        text = heading["text"]
        custom = CUSTOM_ID.search(text)
        if custom is not None:
            found.add(custom["id"])
            continue
        slug, n = slugify(text), 1
        unique = slug
        while unique in found:
            unique, n = f"{slug}_{n}", n + 1
        found.add(unique)
    return found


def test_slugify_matches_markdown_toc() -> None:
    assert slugify("`accel.tracking(project_dir, *, log_with=(\"jsonl\",))`") == (
        "acceltrackingproject_dir-log_withjsonl")
    assert slugify("Context parallelism (long sequences)") == "context-parallelism-long-sequences"
    assert slugify("DeepSpeed's own checkpoints") == "deepspeeds-own-checkpoints"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_anchor_link_names_a_heading(page: Path) -> None:
    dead = []
    for link in LINK.finditer(page.read_text(encoding="utf-8")):
        target = (page.parent / link["target"]).resolve() if link["target"] else page
        if target.suffix != ".md" or "reference" in target.parts:
            continue  # reference pages' ids come from mkdocstrings (the strict build checks them)
        assert target.exists(), f"{page.name} links to {link['target']}, which does not exist"
        if link["anchor"] not in anchors(target):
            dead.append(f"{link['target'] or page.name}#{link['anchor']}")
    assert not dead, (f"{page.relative_to(ROOT)} links to anchors no heading has: {dead}; "
                      "the slug of a heading is its text lowercased, punctuation dropped, "
                      "spaces to hyphens")

"""mkdocs hooks for the docs site (loaded by mkdocs.yml's ``hooks:``).

The guide pages link to files of the repository outside ``docs/`` (``../examples/fsdp.py``,
``../bench/RESULTS.md``), which read well on a forge but are not pages of the site, so
``mkdocs build --strict`` would count them as broken links. Each such link becomes a link to
the file on the forge when ``repo_url`` is set in mkdocs.yml, and otherwise the link text
followed by the repository path in code type (the reader finds it in their clone).
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

# [text](../path) with a relative target that leaves docs/ (one or more leading ../)
OUTSIDE = re.compile(r"\[([^\]]+)\]\(((?:\.\./)+[^)\s#]+)(#[^)\s]*)?\)")


def repository_path(page_uri: str, target: str) -> str | None:
    """The repository path that ``target`` names from ``docs/page_uri``, or ``None`` when
    the target stays inside ``docs/``."""
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))
    if joined.startswith("docs/") or joined.startswith(".."):
        return None
    return joined + ("/" if target.endswith("/") else "")


def rewrite_outside_links(markdown: str, page_uri: str, repo_url: str | None) -> str:
    """``markdown`` with its links to files outside ``docs/`` rewritten (see the module)."""

    def replace(match: re.Match[str]) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        path = repository_path(page_uri, target)
        if path is None:
            return match.group(0)
        if repo_url:
            return f"[{text}]({repo_url.rstrip('/')}/blob/main/{path}{anchor})"
        return text if path.strip("/") in text else f"{text} (`{path}`)"

    return OUTSIDE.sub(replace, markdown)


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    return rewrite_outside_links(markdown, page.file.src_uri, config.get("repo_url"))

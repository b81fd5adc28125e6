"""The API reference (docs/reference/) covers every public name, and the front page's table is
the README's. Fast: reads the pages and the docstrings, builds nothing (``mkdocs build
--strict`` in .ci/run renders them and fails on a reference it cannot resolve).

Public modules: the top level ``accel``, and the modules whose ``__all__`` a script or a test
imports names from (PUBLIC_MODULES). Each name of ``accel.__all__`` has its own
``::: accel.NAME`` line; each other name of a public module's ``__all__`` is rendered by a
``::: MODULE.NAME`` line, a ``members: [...]`` list, or its whole module (WHOLE).
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import accel
from tests.docs.blocks import ROOT

REFERENCE = ROOT / "docs" / "reference"
PUBLIC_MODULES = (
    "accel.errors", "accel.testing", "accel.trackers", "accel.trackers.base",
    "accel.trackers.jsonl", "accel.data", "accel.checkpoint", "accel.weights",
    "accel.big_model", "accel.launch",
)
# rendered whole: their members come from __all__ (minus the `filters` a page gives)
WHOLE = {"accel.errors", "accel.testing", "accel.trackers.base", "accel.trackers.jsonl"}
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)


def _rendered() -> set[str]:
    return {m for page in REFERENCE.glob("*.md")
            for m in DIRECTIVE.findall(page.read_text(encoding="utf-8"))}


def test_every_public_name_has_a_reference_entry() -> None:
    rendered = _rendered()
    missing = [f"accel.{n}" for n in accel.__all__ if f"accel.{n}" not in rendered]
    for module in PUBLIC_MODULES:
        assert module in rendered, f"the public module {module} has no `::: {module}` entry"
        names = importlib.import_module(module).__all__
        if module not in WHOLE:
            missing += [f"{module}.{n}" for n in names
                        if f"{module}.{n}" not in rendered and f"accel.{n}" not in rendered
                        and not _members_option_lists(module, n)]
    assert not missing, (
        f"public names without an entry in docs/reference/*.md: {missing}; add a "
        "`::: accel.NAME` line to the page of its group (docs/reference/index.md lists them)")
    unknown = sorted(d for d in rendered if not _exists(d))
    assert not unknown, f"reference entries that name nothing: {unknown}"


def _members_option_lists(module: str, name: str) -> bool:
    """Whether a page renders ``module`` with ``members: [... name ...]``."""
    pattern = re.compile(rf"^::: {re.escape(module)}\n(?:    .*\n)*?\s+members: \[([^\]]*)\]",
                         re.MULTILINE)
    return any(name in [m.strip() for m in found.split(",")]
               for page in REFERENCE.glob("*.md")
               for found in pattern.findall(page.read_text(encoding="utf-8")))


def _exists(path: str) -> bool:
    module, _, name = path.rpartition(".")
    try:
        importlib.import_module(path)
        return True
    except ImportError:
        return hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", [n for n in accel.__all__ if n != "__version__"])
def test_every_public_name_has_an_example(name: str) -> None:
    obj = getattr(accel, name)
    doc = inspect.getdoc(obj) or ""
    assert doc and obj.__doc__, f"accel.{name} has no docstring"
    assert re.search(r"^Examples?:$", doc, re.MULTILINE), (
        f"accel.{name}'s docstring has no `Example:` section (the reference shows it)")


def test_the_version_is_documented() -> None:
    source = (ROOT / "accel" / "__init__.py").read_text(encoding="utf-8")
    assert re.search(r'^__version__ = ".*"\n"""[^"]+Example:', source, re.MULTILINE)


def _table(text: str) -> str:
    lines = text.split("\n")
    start = lines.index("## What is in the box")
    rows: list[str] = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return "\n".join(rows)


def test_the_front_page_table_is_the_readmes() -> None:
    """docs/index.md repeats the README's "What is in the box" table, its links relative to
    docs/ (the README's ``](docs/x.md)`` is ``](x.md)`` there)."""
    expected = _table((ROOT / "README.md").read_text(encoding="utf-8")).replace("](docs/", "](")
    assert expected, "README.md has no `## What is in the box` table"
    front = _table((ROOT / "docs" / "index.md").read_text(encoding="utf-8"))
    assert front == expected, (
        "docs/index.md's table differs from README.md's; replace it with:\n" + expected)

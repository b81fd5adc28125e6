"""A griffe extension for the docs site: docstrings as accel writes them, read as Markdown.

accel's docstrings name other objects the Sphinx way (``:func:`accel.prepare_model```,
``:class:`~accel.data.PreparedDataLoader```). Markdown has no such roles, so each one becomes
an *optional* autorefs link: a link to the object's reference entry when the site has one, the
name in code type otherwise (never a broken link, never a build warning). ``~`` keeps only the
last part of the name, as in Sphinx. An ``Example:`` section is read as griffe's
``Examples:`` (its ``>>>`` lines rendered as Python). Loaded by mkdocs.yml (mkdocstrings'
``extensions``).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([\w.]+)(\(\))?`")
# accel's house style titles the section "Example:"; griffe's Google parser reads only
# "Examples:" as the section whose ``>>>`` lines are code (else they are Markdown quotes)
EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


def _link(match: re.Match[str], module: str) -> str:
    tilde, target, call = match.group(1), match.group(2), match.group(3) or ""
    shown = target.rsplit(".", 1)[-1] if tilde else target
    identifier = target if "." in target else f"{module}.{target}"
    return (f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(shown + call)}</code></autoref>")


def rewrite_roles(text: str, module: str) -> str:
    """``text`` with each Sphinx role replaced by an optional autorefs link."""
    return ROLE.sub(lambda m: _link(m, module), text)


def rewrite_docstring(text: str, module: str) -> str:
    """``text`` as griffe should parse it: roles rewritten, ``Example:`` read as ``Examples:``."""
    return EXAMPLE.sub(r"\1Examples:", rewrite_roles(text, module))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring griffe reads (see :func:`rewrite_docstring`)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            module = obj.module.path if not obj.is_module else obj.path
            obj.docstring.value = rewrite_docstring(obj.docstring.value, module)

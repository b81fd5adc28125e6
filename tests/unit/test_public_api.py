"""The top-level namespace: what ``import accel`` offers, and one import path per name.

- The top level holds :class:`accel.AccelError` and the errors scripts catch; every other
  error is imported from :mod:`accel.errors` only.
- Every subpackage is an attribute of ``accel`` after a plain ``import accel``, imported on
  first access (``import accel`` itself loads neither torch nor any subpackage).
- No module re-exports a name it imports: an error class appears in the ``__all__`` of
  ``accel.errors`` (and of ``accel`` for the few above) and nowhere else.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import accel
import accel.errors

PACKAGE = Path(accel.__file__).resolve().parent

CAUGHT = {
    "AccelError", "CheckpointError", "CollectiveTimeoutError", "ConfigError", "LaunchError",
    "RemoteError",
}


def test_the_top_level_offers_the_errors_scripts_catch() -> None:
    top_errors = {
        name for name in accel.__all__
        if isinstance(getattr(accel, name), type)
        and issubclass(getattr(accel, name), BaseException)
    }
    assert top_errors == CAUGHT
    for name in CAUGHT:
        assert getattr(accel, name) is getattr(accel.errors, name)
    assert not hasattr(accel, "DeviceMapError")
    assert accel.errors.DeviceMapError.__module__ == "accel.errors"


@pytest.mark.slow
def test_every_subpackage_is_a_lazy_attribute() -> None:
    packages = {
        path.parent.name for path in PACKAGE.glob("*/__init__.py")
        if not path.parent.name.startswith("_")
    }
    assert packages <= set(accel._SUBMODULES)
    assert set(accel._SUBMODULES) <= set(dir(accel))
    code = (
        "import sys, json, accel\n"
        "before = sorted(m for m in sys.modules if m == 'torch' or m.startswith('accel.'))\n"
        f"names = {sorted(accel._SUBMODULES)!r}\n"
        "kinds = [type(getattr(accel, n)).__name__ for n in names]\n"
        "print(json.dumps([before, kinds, accel.big_model.dispatch_model.__name__]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120)
    before, kinds, name = json.loads(done.stdout)
    assert before == ["accel.errors"]
    assert kinds == ["module"] * len(accel._SUBMODULES)
    assert name == "dispatch_model"


_PENDING: set[str] = set()  # re-exports allowed for now: none


def _all_names(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__"
                and isinstance(node.value, ast.List | ast.Tuple)):
            return [e.value for e in node.value.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def test_no_module_re_exports_an_error_class() -> None:
    errors = set(accel.errors.__all__)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ("errors.py", "__init__.py"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found += [f"accel/{relative}: __all__ lists {n}" for n in _all_names(tree) if n in errors]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "accel.errors":
                found += [f"accel/{relative}: imports {a.name} as itself"
                          for a in node.names if a.asname == a.name]
    assert sorted(set(found) - _PENDING) == []


def _is_public(relative: Path) -> bool:
    """Public-named: no ``_name`` part below accel (``__init__`` and ``__main__`` aside;
    ``accel._files`` is private to accel as a whole but its modules are named for accel)."""
    parts = [p for p in relative.with_suffix("").parts if p not in ("__init__", "__main__")]
    return not any(p.startswith("_") and p != "_files" for p in parts)


def test_every_public_module_says_what_it_exports() -> None:
    """``__all__`` in every public-named module: what other packages (and users) may import."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name == "__main__.py" or not _is_public(relative):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if not any(name == "__all__" for name in _assigned_names(tree)):
            missing.append(str(relative))
    assert missing == []


def _assigned_names(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names

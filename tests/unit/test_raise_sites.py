"""Every error accel raises on purpose is an ``accel.AccelError`` defined in ``accel/errors.py``.

The source of ``accel/`` is read with ``ast`` (nothing is imported): a ``raise`` of a bare
builtin exception class (``raise ValueError(...)``, ``raise TypeError``, ``raise
RuntimeError(...) from exc``...) fails the test, and so does an exception class defined in
another module. A bare ``raise`` and ``raise error`` of a variable (re-raising a caught
exception) are allowed. The few exceptions below are listed with their reasons.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import accel
import accel.errors

PACKAGE = Path(accel.__file__).resolve().parent
SOURCES = sorted(PACKAGE.rglob("*.py"))

BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)

# (module path relative to accel/, builtin raised) -> why it is not an AccelError
RAISE_ALLOWLIST: dict[tuple[str, str], str] = {
    ("_files/atomic.py", "OSError"): (
        "exchange() reports the errno of the renameat2 system call as the OSError os.rename "
        "would raise; it is an operating-system failure, not a check of accel's"
    ),
    ("launch/worker.py", "SystemExit"): (
        "the worker's command line sets its exit status (usage message, script's own exit)"
    ),
}

# (module path relative to accel/, class name) -> why it is defined outside errors.py
CLASS_ALLOWLIST: dict[tuple[str, str], str] = {
    ("testing/__init__.py", "_RemoteTraceback"): (
        "never raised: it carries a worker's formatted traceback as the __cause__ of the "
        "error run_distributed re-raises"
    ),
    ("parallel/pipeline/split.py", "StageExit"): (
        "never escapes: a BaseException that ends a pipeline stage's forward at the next "
        "stage's first module, caught by the stage module around that forward"
    ),
}


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _raised_name(node: ast.Raise) -> str | None:
    """The class name of ``raise Name(...)`` / ``raise Name`` / ``raise mod.Name(...)``."""
    exc = node.exc
    if exc is None:
        return None
    target = exc.func if isinstance(exc, ast.Call) else exc
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


class _RaiseFinder(ast.NodeVisitor):
    """Collects ``raise`` of builtin exception classes, knowing the enclosing function."""

    def __init__(self) -> None:
        self.functions: list[str] = []
        self.found: list[tuple[int, str, str]] = []  # line, builtin, enclosing function

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_Raise(self, node: ast.Raise) -> None:
        name = _raised_name(node)
        if name in BUILTIN_EXCEPTIONS:
            function = self.functions[-1] if self.functions else "<module>"
            self.found.append((node.lineno, name, function))
        self.generic_visit(node)


def _bare_raises(source: str, relative: str) -> list[str]:
    finder = _RaiseFinder()
    finder.visit(ast.parse(source))
    problems = []
    for line, name, function in finder.found:
        if name == "AttributeError" and function == "__getattr__":
            continue  # the attribute protocol: getattr() and hasattr() expect AttributeError
        if (relative, name) in RAISE_ALLOWLIST:
            continue
        problems.append(f"accel/{relative}:{line}: raise {name} in {function}()")
    return problems


def _exception_classes(source: str, known: set[str]) -> list[tuple[int, str]]:
    """Classes deriving (directly, or through another class of the module) from an exception.

    ``known`` holds the names that are exception classes: builtins and accel.errors' names.
    """
    found = []
    names = set(known)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {
            base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            for base in node.bases
        }
        if bases & names:
            names.add(node.name)
            found.append((node.lineno, node.name))
    return found


def test_the_scan_sees_the_whole_package() -> None:
    relatives = {_relative(path) for path in SOURCES}
    assert {"errors.py", "comm/collectives.py", "checkpoint/state.py", "cli/main.py"} <= relatives


def test_the_raise_scan_finds_bare_builtins_and_skips_accel_errors_and_reraises() -> None:
    source = (
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('bad')\n"
        "    try:\n"
        "        g()\n"
        "    except OSError as exc:\n"
        "        raise ConfigError('wrapped') from exc\n"
        "    except KeyError as exc:\n"
        "        raise RuntimeError('no') from exc\n"
        "    except Exception as exc:\n"
        "        raise exc\n"
        "    except BaseException:\n"
        "        raise\n"
        "    raise builtins.TypeError\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(name)\n"
    )
    assert _bare_raises(source, "x.py") == [
        "accel/x.py:3: raise ValueError in f()",
        "accel/x.py:9: raise RuntimeError in f()",
        "accel/x.py:14: raise TypeError in f()",
    ]


def test_the_class_scan_finds_error_classes_through_local_bases() -> None:
    source = (
        "class A(AccelError, TypeError): pass\n"
        "class B(A): pass\n"
        "class C: pass\n"
        "class D(errors.ConfigError): pass\n"
    )
    assert _exception_classes(source, {"AccelError", "TypeError", "ConfigError"}) == [
        (1, "A"),
        (2, "B"),
        (4, "D"),
    ]


def test_no_raise_of_a_bare_builtin_exception() -> None:
    problems = []
    for path in SOURCES:
        problems += _bare_raises(path.read_text(encoding="utf-8"), _relative(path))
    assert not problems, (
        "raise an accel.errors class deriving from AccelError and the builtin instead:\n"
        + "\n".join(problems)
    )


def test_the_allowlists_have_no_stale_entries() -> None:
    for relative, name in RAISE_ALLOWLIST:
        finder = _RaiseFinder()
        finder.visit(ast.parse((PACKAGE / relative).read_text(encoding="utf-8")))
        assert any(found == name for _, found, _ in finder.found), (relative, name)
    for relative, name in CLASS_ALLOWLIST:
        source = (PACKAGE / relative).read_text(encoding="utf-8")
        assert (relative, name) in {
            (relative, found)
            for _, found in _exception_classes(source, {"Exception", "BaseException"})
        }


def test_every_error_class_is_defined_in_errors_py() -> None:
    known = set(BUILTIN_EXCEPTIONS) | set(accel.errors.__all__) | {"FrozenInstanceError"}
    outside = []
    for path in SOURCES:
        relative = _relative(path)
        if relative == "errors.py":
            continue
        for line, name in _exception_classes(path.read_text(encoding="utf-8"), known):
            if (relative, name) not in CLASS_ALLOWLIST:
                outside.append(f"accel/{relative}:{line}: class {name}")
    assert not outside, "move these classes to accel/errors.py:\n" + "\n".join(outside)


def test_every_error_of_errors_py_is_an_accel_error_and_a_builtin() -> None:
    for name in accel.errors.__all__:
        cls = getattr(accel.errors, name)
        assert issubclass(cls, accel.AccelError), name
        if cls is not accel.AccelError:
            builtin_bases = [
                base for base in cls.__mro__
                if base.__module__ == "builtins" and base not in (Exception, BaseException, object)
            ]
            assert builtin_bases, f"{name} specialises no builtin exception"


def test_every_error_class_is_listed_in_errors_all() -> None:
    defined = {
        name
        for name, value in vars(accel.errors).items()
        if isinstance(value, type) and issubclass(value, BaseException)
        and value.__module__ == "accel.errors"
    }
    assert defined == set(accel.errors.__all__)

"""Imports inside accel only flow down the layers recorded in docs/architecture.md.

The import graph is drawn from the source with ``ast``: every ``import``/``from ... import``
naming an accel module, at module level or inside a function (a lazy import is a dependency
too). Run this file as a script to print the graph with each module's layer. The page also
names every module in a group; a module it does not name fails here. The graph has no cycle,
and neither has the graph of accel's packages (``accel.checkpoint``, ``accel.big_model``... and
each top-level module: one node each, an edge where a module of one imports a module of the
other), nor the graph of its package directories (``accel.parallel`` and
``accel.parallel.pipeline`` are two nodes: a package and its sub-packages import one way). No
package imports another package's ``_private`` module or uses another's ``_private`` name (here a
package is a directory), and accel/ holds at most six top-level modules. No module outside an
engine's unit (:data:`ENGINE_UNITS`, or :data:`ALLOWED_ENGINE_BRANCHES` with its reason) branches
on an engine: it asks the unit instead of ``if st.strategy == "deepspeed"``.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "accel"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Highest first. A module belongs to the first layer with a pattern that matches it: the exact
# name, or ``prefix.*`` for a package's modules. Unlisted modules are in "features".
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("package", ("accel", "accel.cli.selftest", "accel.testing._warm_server")),
    ("tools", (
        "accel.launch", "accel.launch.*", "accel.cli", "accel.cli.*", "accel.testing",
        "accel.testing.*",
    )),
    # named for the page; every module not listed above or below is in this layer too
    ("features", ("accel.data", "accel.data.*", "accel.parallel", "accel.parallel.*")),
    ("distributed", ("accel.core.process_group",)),
    ("state", (
        "accel.core", "accel.core.state", "accel.core.scope", "accel.core.options",
        "accel.core.mesh", "accel.core.seeding", "accel.core.tree", "accel.core.sizes",
        "accel.core.lazy", "accel.core.exit_refs", "accel.core.once", "accel.core.agreement",
        "accel.core.arrival", "accel.core.global_batch", "accel.core.liveness",
        "accel.core.machines", "accel.core.failure_record",
    )),
    ("config file", ("accel.core.config_file",)),
    ("environment", ("accel.core.env",)),
    ("settings", (
        "accel.core.settings", "accel.core.setting_values", "accel.core.strict_json",
        "accel.core.engine_facts",
    )),
    ("errors", ("accel.errors",)),
]
_FEATURES = [name for name, _ in LAYERS].index("features")


def layer_of(module: str) -> int:
    """Index of the module's layer in :data:`LAYERS` (0 is the highest)."""
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (
                pattern.endswith(".*") and module.startswith(pattern[:-1])
            ):
                return index
    return _FEATURES


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base.pop()
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def parsed_modules(package: Path = PACKAGE) -> dict[str, tuple[Path, ast.Module]]:
    """Each accel module, its file and its syntax tree (parsed once per run)."""
    return {
        _module_name(p, package.parent): (p, ast.parse(p.read_text(encoding="utf-8"), str(p)))
        for p in sorted(package.rglob("*.py"))
    }


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each accel module and the accel modules it imports (``accel`` for the package itself).

    ``from accel import __version__`` is not counted: it reads the package's metadata, which
    is loaded before any of its modules.
    """
    sources = parsed_modules(package)
    paths = {module: path for module, (path, _) in sources.items()}
    graph: dict[str, set[str]] = {}
    for module, (path, tree) in sources.items():
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "accel")
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                if target.split(".")[0] != "accel":
                    continue
                names = [a.name for a in node.names]
                if target == "accel" and names == ["__version__"]:
                    continue
                for name in names:  # `from accel.launch import config` imports a module
                    full = f"{target}.{name}"
                    deps.add(full if full in paths else target)
        deps.discard(module)
        graph[module] = deps
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one, as readable lines."""
    found = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer_of(dep) < layer_of(module):
                found.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} "
                    f"({LAYERS[layer_of(dep)][0]})"
                )
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of the graph: each group of modules that import each other, directly or not.

    A group is a strongly connected component of more than one module (Tarjan's algorithm,
    without recursion), sorted; the groups are sorted by their first module.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, deps = work[-1]
            dep = next((d for d in deps if d in graph), None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph[dep]))))
                elif dep in on_stack:
                    low[module] = min(low[module], index[dep])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return sorted(cycles)


def package_of(module: str) -> str:
    """The package a module belongs to: ``accel.x`` for ``accel.x`` and every module under it;
    a top-level module (``accel.errors``) is a package of its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each package of accel (a subpackage, or a top-level module) and the packages its modules
    import. The facade ``accel`` itself (``__init__.py``) is left out: it names everything."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module == "accel":
            continue
        source = package_of(module)
        targets = out.setdefault(source, set())
        targets.update(p for p in map(package_of, deps) if p not in ("accel", source))
    return out


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of another package's private module (a ``_name`` below its package), as
    readable lines. A package's ``_private`` modules are its own; others use public names."""
    found = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if package_of(dep) == package_of(module):
                continue
            if any(part.startswith("_") for part in dep.split(".")[2:]):
                found.append(f"{module} imports {dep}, private to {package_of(dep)}")
    return found


def top_level_modules(package: Path = PACKAGE) -> list[str]:
    """The modules directly in ``accel/`` (``__init__.py`` included)."""
    return sorted(p.name for p in package.glob("*.py"))


# --- packages as directories: private names, cycles between a package and its sub-packages ---

# private to accel as a whole, shared by its packages: its modules have public names (but the
# ``_private`` names inside them are still their package's own)
SHARED_PRIVATE_PACKAGES = ("accel._files",)


def package_dirs(package: Path = PACKAGE) -> set[str]:
    """The accel modules that are packages (a directory with an ``__init__.py``)."""
    return {m for m, (path, _) in parsed_modules(package).items() if path.name == "__init__.py"}


def _inferred_packages(modules: Iterable[str]) -> set[str]:
    names = set(modules)
    return {"accel"} | {n for n in names if any(o.startswith(f"{n}.") for o in names)}


def directory_of(module: str, packages: set[str]) -> str:
    """The package a module belongs to, as its directory: ``accel.checkpoint`` for
    ``accel.checkpoint.state`` and ``accel.checkpoint.sharded`` for
    ``accel.checkpoint.sharded.reshard`` (two packages); a package is its own; a top-level
    module (``accel.errors``) is a package of its own."""
    if module in packages:
        return module
    parent = module.rpartition(".")[0]
    return module if parent in ("", "accel") else parent


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_owner(path: str, packages: set[str]) -> tuple[str, str] | None:
    """For a dotted path to a module or a name (``accel.a.y._x``), its first private part:
    the package that owns it and the path up to it (``("accel.a", "accel.a.y._x")``)."""
    parts = path.split(".")
    for i in range(1, len(parts)):
        if not _is_private(parts[i]):
            continue
        prefix = ".".join(parts[: i + 1])
        if prefix in SHARED_PRIVATE_PACKAGES:
            continue
        return directory_of(".".join(parts[:i]), packages), prefix
    return None


def _accel_aliases(module: str, path: Path, tree: ast.Module, modules: set[str]) -> dict[str, str]:
    """The local names a module binds to accel modules (``import accel.x.y as m``,
    ``from accel.x import y``, ``import accel.x``), anywhere in the file."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "accel":
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["accel"] = "accel"
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target.split(".")[0] != "accel":
                continue
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
    return aliases


def _module_of(node: ast.expr, aliases: dict[str, str], modules: set[str]) -> str | None:
    """The accel module an expression names (``m``, ``accel.x.y``), or None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _module_of(node.value, aliases, modules)
        if base is not None and f"{base}.{node.attr}" in modules:
            return f"{base}.{node.attr}"
    return None


def private_names_used(package: Path = PACKAGE) -> list[str]:
    """Every use of another package's private name (a module or a name starting with one
    underscore), as readable lines: ``from accel.x.y import _name``, ``import accel.x._y``,
    or ``m._name`` after ``import accel.x.y as m``. A package is a directory here:
    ``accel.checkpoint.sharded`` may not use ``accel.checkpoint``'s private names, nor the
    reverse; a top-level module is a package of its own."""
    sources = parsed_modules(package)
    modules = set(sources)
    packages = package_dirs(package)
    found: set[tuple[str, int, str, str]] = set()
    for module, (path, tree) in sources.items():
        here = directory_of(module, packages)
        aliases = _accel_aliases(module, path, tree, modules)
        for node in ast.walk(tree):
            used: list[str] = []
            if isinstance(node, ast.Import):
                used = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path, node)
                used = [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                base = _module_of(node.value, aliases, modules)
                used = [f"{base}.{node.attr}"] if base is not None else []
            for name in used:
                if name.split(".")[0] != "accel":
                    continue
                owner = _private_owner(name, packages)
                if owner is None:
                    continue
                owning, prefix = owner
                if here in (owning, prefix) or here.startswith(f"{prefix}."):
                    continue
                found.add((module, getattr(node, "lineno", 0), prefix, owning))
    return [f"{module} (line {line}) uses {prefix}, private to {owning}"
            for module, line, prefix, owning in sorted(found)]


def directory_graph(
    graph: dict[str, set[str]], packages: set[str] | None = None
) -> dict[str, set[str]]:
    """Each package directory of accel (``accel.parallel``, ``accel.parallel.pipeline``... and
    each top-level module) and the package directories its modules import. The facade
    ``accel`` itself is left out: it names everything."""
    packages = _inferred_packages(graph) if packages is None else packages
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module == "accel":
            continue
        source = directory_of(module, packages)
        targets = out.setdefault(source, set())
        targets.update(
            d for d in (directory_of(dep, packages) for dep in deps) if d not in ("accel", source)
        )
    return out


def cycle_imports(
    graph: dict[str, set[str]], cycle: list[str], packages: set[str] | None = None
) -> list[str]:
    """The module imports that join the packages of one directory cycle, as readable lines."""
    packages = _inferred_packages(graph) if packages is None else packages
    members = set(cycle)
    lines = []
    for module, deps in sorted(graph.items()):
        source = directory_of(module, packages)
        if module == "accel" or source not in members:
            continue
        for dep in sorted(deps):
            target = directory_of(dep, packages)
            if target in members and target != source:
                lines.append(f"  {module} imports {dep}")
    return lines


# --- no engine branch outside the engine's unit -----------------------------------------------

# Each engine's unit and its modules (``fnmatch`` patterns): only these may compare a strategy's
# name, probe an engine's library or branch on the pp/cp mesh dims. Elsewhere code asks the unit.
ENGINE_UNITS: dict[str, tuple[str, ...]] = {
    # unit                               its modules
    "the strategy units and registry":  ("accel.parallel.engines", "accel.parallel.engines.*"),
    "DeepSpeed":                        ("accel.parallel.deepspeed", "accel.parallel.deepspeed.*"),
    "FSDP2":                            ("accel.parallel.fsdp*",),
    "DDP":                              ("accel.parallel.ddp*",),
    "pipeline parallelism (pp)":        ("accel.parallel.pipeline", "accel.parallel.pipeline.*"),
    "context parallelism (cp)":         ("accel.parallel.context_parallel",
                                         "accel.parallel.context_parallel.*"),
    "precision modes (fp8 is its unit)": ("accel.precision", "accel.precision.*"),
    "the mesh dims themselves":         ("accel.core.mesh",),
}  # the strategy units: single process, DDP, FSDP, DeepSpeed (and their registry)

# The few other places that name an engine, each with its reason. Keep it short.
ALLOWED_ENGINE_BRANCHES: dict[str, str] = {
    "accel": "the public exports: the lazy names of every engine's functions",
    "accel.core.settings": "the settings table: each strategy and mode defined once, with choices",
    "accel.launch.run": "launch flags (`--strategy`, the mesh sizes `--pp-size`...) and torchrun's",
    "accel.launch.config": "launch flags read from the config file, passed on to the workers",
    "accel.cli.estimate": "`accel estimate-memory --strategy` asks for an engine by name",
    "accel.cli.envinfo": "`accel env` reports the chosen engine and the notes that go with it",
    "accel.cli.config_import": "`accel config import` translates Accelerate's engine names",
    "accel.cli.checkpoint_report": "`accel checkpoint` reports the format that wrote a directory "
    "(accel, Accelerate or DeepSpeed's own), by name",
    "accel.cli.checkpoint_source": "`accel merge-weights` reads a checkpoint by its format's name",
    "accel.cli.commands": "`accel merge-weights` reports the format it read, by name",
    "accel.checkpoint.sharded.pieces": "a piece's coordinates on the mesh: each pipeline stage "
    "writes the pieces of its own `pp` coordinate",
    "accel.checkpoint.sharded.stages": "the pipeline's part of a checkpoint (stages saved under "
    "global names): a stage's first rank is 0 on every mesh dim but `pp`",
}

# every strategy choice but "none" (too common a word: it counts next to a strategy), and fp8
ENGINE_NAMES = frozenset({"ddp", "fsdp", "deepspeed", "fp8"})
# an engine's library, as a part of a module name (``torch.distributed.fsdp``; torchao is fp8's)
ENGINE_LIBRARIES = frozenset({"deepspeed", "fsdp", "torchao"})
MESH_DIM_NAMES = frozenset({"pp_world_size", "cp_world_size", "pp_size", "cp_size"})
MESH_DIMS = frozenset({"pp", "cp"})  # the dims' names in a DeviceMesh: ``mesh["pp"]``


def in_engine_unit(module: str) -> str | None:
    """The engine unit a module belongs to (a key of :data:`ENGINE_UNITS`), or None."""
    for unit, patterns in ENGINE_UNITS.items():
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return unit
    return None


def _parts(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and the nodes below it, without the literal text of f-strings."""
    stack = [node]
    while stack:
        item = stack.pop()
        yield item
        stack.extend(
            child for child in ast.iter_child_nodes(item)
            if not (isinstance(item, ast.JoinedStr) and isinstance(child, ast.Constant))
        )


def _is_sys_modules(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == "modules"
        and isinstance(node.value, ast.Name) and node.value.id == "sys"
    )


def _names_library(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
        and bool(ENGINE_LIBRARIES & set(node.value.lower().split(".")))
    )


def _branch_reason(node: ast.AST) -> str | None:
    """Why a comparison (or a ``match`` subject) branches on an engine, or None: an engine's
    name, ``x.strategy``, an engine's library in ``sys.modules``, or a pp/cp mesh dim."""
    strings: list[str] = []
    strategy_name = modules = False
    keys: set[int] = set()
    for part in _parts(node):
        if isinstance(part, ast.Constant) and isinstance(part.value, str) and id(part) not in keys:
            strings.append(part.value.lower())
        elif isinstance(part, ast.Attribute) and part.attr == "strategy":
            return "x.strategy"
        elif isinstance(part, ast.Attribute | ast.Name) and (
            (part.attr if isinstance(part, ast.Attribute) else part.id) in MESH_DIM_NAMES
        ):
            return "a mesh dim"
        elif (isinstance(part, ast.Name) and part.id == "strategy") or (
            isinstance(part, ast.Subscript) and isinstance(part.slice, ast.Constant)
            and part.slice.value == "strategy"
        ):
            strategy_name = True
            keys.add(id(getattr(part, "slice", None)))  # the key "strategy" is no name compared
        modules = modules or _is_sys_modules(part)
    if any(s in ENGINE_NAMES for s in strings):
        return "an engine's name"
    if any(s in MESH_DIMS for s in strings):
        return "a mesh dim"
    if modules and any(ENGINE_LIBRARIES & set(s.split(".")) for s in strings):
        return "an engine's library"
    if strategy_name and strings:
        return "a strategy's name"
    return None


class _EngineBranches(ast.NodeVisitor):
    """Collects the engine branches of one module: comparisons (see :func:`_branch_reason`),
    ``match`` on an engine, and probes of an engine's library (``sys.modules.get("deepspeed")``,
    ``sys.modules["deepspeed"]``, ``find_spec("deepspeed")``)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str, str]] = []

    def _add(self, node: ast.expr | ast.stmt, reason: str, text: str | None = None) -> None:
        self.found.append((node.lineno, reason, text or ast.unparse(node)))

    def visit_Compare(self, node: ast.Compare) -> None:
        reason = _branch_reason(node)
        if reason is None:
            self.generic_visit(node)
        else:
            self._add(node, reason)

    def visit_Match(self, node: ast.Match) -> None:
        cases = {p.value.value.lower() for c in node.cases for p in ast.walk(c.pattern)
                 if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant)
                 and isinstance(p.value.value, str)}
        reason = _branch_reason(node.subject)
        if reason is None and cases & (ENGINE_NAMES | MESH_DIMS):
            reason = "an engine's name"
        if reason is None and cases and isinstance(node.subject, ast.Name) and (
            node.subject.id == "strategy"
        ):
            reason = "a strategy's name"
        if reason is not None:
            self._add(node, reason, f"match {ast.unparse(node.subject)}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        probe = (isinstance(func, ast.Attribute) and func.attr == "get"
                 and _is_sys_modules(func.value)) or (
            (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None))
            == "find_spec"
        )
        if probe and node.args and _names_library(node.args[0]):
            self._add(node, "an engine's library")
        else:
            self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if _is_sys_modules(node.value) and _names_library(node.slice):
            self._add(node, "an engine's library")
        else:
            self.generic_visit(node)


def engine_branches_in(tree: ast.AST) -> list[str]:
    """The engine branches of one syntax tree, as ``line N: code (why)``; docstrings, error
    messages and every other string that is not compared are not branches."""
    visitor = _EngineBranches()
    visitor.visit(tree)
    return [f"line {n}: {text}  ({reason})"
            for n, text, reason in sorted((n, t, r) for n, r, t in visitor.found)]


def engine_branches(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Each accel module outside the engines' units (and :data:`ALLOWED_ENGINE_BRANCHES`) that
    branches on an engine, and its branches. tests/ are not scanned: a test-only engine is
    registered from there."""
    found = {}
    for module, (_, tree) in sorted(parsed_modules(package).items()):
        if in_engine_unit(module) or module in ALLOWED_ENGINE_BRANCHES:
            continue
        branches = engine_branches_in(tree)
        if branches:
            found[module] = branches
    return found


def test_imports_only_flow_down() -> None:
    graph = import_graph()
    assert "accel.core.settings" in graph and "accel.core.process_group" in graph
    assert upward_imports(graph) == []


def test_no_import_cycle() -> None:
    assert import_cycles(import_graph()) == []


def test_no_cycle_between_packages() -> None:
    packages = package_graph(import_graph())
    assert {"accel.checkpoint", "accel.big_model", "accel.launch", "accel.cli"} <= set(packages)
    assert "accel.errors" in packages  # top-level modules are nodes too
    assert "accel.weights" in packages["accel.big_model"]  # big models load weights
    assert import_cycles(packages) == []


def test_no_package_imports_another_packages_private_modules() -> None:
    assert private_imports(import_graph()) == []


def test_a_private_import_is_found() -> None:
    graph = {
        "accel.a._x": set(), "accel.a.y": {"accel.a._x"}, "accel.b.z": {"accel.a._x"},
        "accel._f.w": set(), "accel.c": {"accel._f.w"}, "accel.d": {"accel._f._v"},
    }
    assert private_imports(graph) == [
        "accel.b.z imports accel.a._x, private to accel.a",
        "accel.d imports accel._f._v, private to accel._f",
    ]


def test_the_top_level_holds_at_most_six_modules() -> None:
    """``__init__.py``, ``errors.py`` and a few run utilities: the rest lives in packages."""
    modules = top_level_modules()
    assert {"__init__.py", "errors.py"} <= set(modules)
    assert len(modules) <= 6, modules


def test_a_package_cycle_is_found() -> None:
    graph = {
        "accel.a": set(), "accel.a.x": {"accel.b.y"}, "accel.a.w": {"accel.m"},
        "accel.b": set(), "accel.b.y": set(), "accel.b.z": {"accel.a"},
        "accel.c": set(), "accel.c.q": {"accel.a.x"}, "accel.m": {"accel.a.x"},
    }
    assert package_graph(graph) == {
        "accel.a": {"accel.b", "accel.m"}, "accel.b": {"accel.a"}, "accel.c": {"accel.a"},
        "accel.m": {"accel.a"},
    }  # accel.m is a top-level module: a package of its own, in the cycle through accel.a
    assert import_cycles(package_graph(graph)) == [["accel.a", "accel.b", "accel.m"]]
    del graph["accel.b.z"]
    assert import_cycles(package_graph(graph)) == [["accel.a", "accel.m"]]


def test_a_cycle_is_found() -> None:
    graph = {
        "accel.a": {"accel.b"}, "accel.b": {"accel.c", "accel.z"}, "accel.c": {"accel.a"},
        "accel.d": {"accel.d2"}, "accel.d2": {"accel.d"}, "accel.e": {"accel.a"},
        "accel.z": set(),
    }
    assert import_cycles(graph) == [["accel.a", "accel.b", "accel.c"], ["accel.d", "accel.d2"]]
    assert import_cycles({"accel.a": {"accel.b"}, "accel.b": set()}) == []


def test_data_and_parallel_are_independent() -> None:
    """The loaders know nothing of model parallelism, and the reverse."""
    graph = import_graph()
    data = {m for m in graph if m == "accel.data" or m.startswith("accel.data.")}
    parallel = {m for m in graph if m == "accel.parallel" or m.startswith("accel.parallel.")}
    assert len(data) >= 10 and len(parallel) >= 7
    assert not any(graph[m] & parallel for m in data)
    assert not any(graph[m] & data for m in parallel)


def test_the_settings_layer_imports_only_errors() -> None:
    graph = import_graph()
    assert graph["accel.core.settings"] <= {"accel.errors"}
    assert graph["accel.core.setting_values"] <= {"accel.core.settings", "accel.errors"}
    assert graph["accel.errors"] == set()


def test_distributed_reads_the_config_file_from_below() -> None:
    graph = import_graph()
    assert "accel.core.config_file" in graph["accel.core.process_group"]
    assert all(dep.startswith(("accel.core.", "accel.errors"))
               for dep in graph["accel.core.process_group"])  # no feature: exit steps instead
    assert layer_of("accel.core.config_file") > layer_of("accel.core.state")


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "accel"
    for sub in ("launch", "core", "training"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "launch" / "run.py").write_text("")
    (pkg / "core" / "env.py").write_text("def f():\n    from accel.launch import run\n")
    (pkg / "training" / "model.py").write_text(
        "from accel.core.env import f\nfrom accel import __version__\n"
    )
    graph = import_graph(pkg)
    assert graph["accel.training.model"] == {"accel.core.env"}
    assert upward_imports(graph) == [
        "accel.core.env (environment) imports accel.launch.run (tools)"
    ]


def named_modules(text: str) -> set[str]:
    """Modules a page names: ```accel.x.y``` in full, or ```accel.x``: ``y``` on one line."""
    named: set[str] = set()
    for line in text.splitlines():
        tokens = re.findall(r"`([^`]+)`", line)
        named.update(tokens)
        for package in (t for t in tokens if t.startswith("accel")):
            named.update(f"{package}.{t}" for t in tokens if t.isidentifier())
    return named


def test_the_architecture_page_names_every_module() -> None:
    missing = sorted(set(import_graph()) - named_modules(ARCHITECTURE.read_text("utf-8")))
    assert missing == [], "add these modules to a group of docs/architecture.md"


def test_a_module_is_named_in_full_or_after_its_package() -> None:
    named = named_modules("| `accel.data`, `accel._loader` |\n| `accel.checkpoint`: `_saving` |")
    assert {"accel.data", "accel._loader", "accel.checkpoint._saving"} <= named
    assert "accel.data._loader" not in named  # names on other lines do not combine


@pytest.mark.parametrize(
    ("module", "layer"),
    [("accel", "package"), ("accel.cli.main", "tools"), ("accel.checkpoint.state", "features"),
     ("accel.data._loader", "features"), ("accel.parallel.fsdp", "features"),
     ("accel.core.state", "state"), ("accel.errors", "errors")],
)
def test_layer_of(module: str, layer: str) -> None:
    assert LAYERS[layer_of(module)][0] == layer


def test_no_package_uses_another_packages_private_names() -> None:
    found = private_names_used()
    assert found == [], (
        "a `_private` name is its package's own (a package is a directory: accel.checkpoint "
        "and accel.checkpoint.sharded are two); import a public name instead:\n"
        + "\n".join(found)
    )


def test_a_private_name_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "accel"
    for sub in ("a", "a/sub", "b", "_files"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("_E = 1\n")
    (pkg / "a" / "y.py").write_text("from ._z import q\n_x = 1\n")
    (pkg / "a" / "_z.py").write_text("from accel.a.y import _x\nq = 1\n")  # its own package
    (pkg / "_files" / "w.py").write_text("_v = 1\n")
    (pkg / "a" / "sub" / "m.py").write_text("from accel.a.y import _x\n")  # a sub-package
    (pkg / "b" / "n.py").write_text(
        "import accel.a.y as m\nimport accel.a.y\nfrom accel._files import w\n"
        "from accel import __version__, errors\n"
        "def f():\n    from accel.a import _z\n    return m._x + accel.a.y._x + w._v + w.ok\n"
        "def g():\n    return errors._E, m.__name__, m.public\n"
    )
    (pkg / "b" / "__init__.py").write_text("from accel.b.n import f as _f\n")  # its own
    assert private_names_used(pkg) == [
        "accel.a.sub.m (line 1) uses accel.a.y._x, private to accel.a",
        "accel.b.n (line 6) uses accel.a._z, private to accel.a",
        "accel.b.n (line 7) uses accel._files.w._v, private to accel._files",
        "accel.b.n (line 7) uses accel.a.y._x, private to accel.a",
        "accel.b.n (line 9) uses accel.errors._E, private to accel.errors",
    ]


def test_no_cycle_between_a_package_and_its_sub_packages() -> None:
    graph = import_graph()
    packages = package_dirs()
    directories = directory_graph(graph, packages)
    assert {"accel.checkpoint", "accel.checkpoint.sharded", "accel.parallel",
            "accel.parallel.pipeline", "accel.errors"} <= set(directories)
    cycles = import_cycles(directories)
    assert cycles == [], "these packages import each other, directly or not:\n" + "\n".join(
        " <-> ".join(cycle) + "\n" + "\n".join(cycle_imports(graph, cycle, packages))
        for cycle in cycles
    )


def test_a_cycle_through_a_sub_package_is_found() -> None:
    graph = {
        "accel": {"accel.p"}, "accel.p": {"accel.p.s"}, "accel.p.m": {"accel.e"},
        "accel.p.s": {"accel.p.s.x"}, "accel.p.s.x": {"accel.p.m"}, "accel.e": set(),
        "accel.q": set(), "accel.q.r": {"accel.p.s.x", "accel"},
    }
    assert directory_graph(graph) == {
        "accel.p": {"accel.p.s", "accel.e"}, "accel.p.s": {"accel.p"}, "accel.e": set(),
        "accel.q": {"accel.p.s"},
    }
    assert import_cycles(package_graph(graph)) == []  # one package at the top level
    assert import_cycles(directory_graph(graph)) == [["accel.p", "accel.p.s"]]
    assert cycle_imports(graph, ["accel.p", "accel.p.s"]) == [
        "  accel.p imports accel.p.s", "  accel.p.s.x imports accel.p.m",
    ]
    del graph["accel.p.s.x"]
    assert import_cycles(directory_graph(graph)) == []


def test_no_engine_branch_outside_its_unit() -> None:
    found = engine_branches()
    assert found == {}, (
        "ask the engine's unit instead of naming the engine (units: "
        + ", ".join(ENGINE_UNITS) + "):\n"
        + "\n".join(f"{module}:\n" + "\n".join(f"  {b}" for b in branches)
                    for module, branches in found.items())
    )


def test_the_units_and_the_allowed_modules_exist() -> None:
    graph = import_graph()
    assert set(ALLOWED_ENGINE_BRANCHES) <= set(graph)
    assert not [m for m in ALLOWED_ENGINE_BRANCHES if in_engine_unit(m)]
    empty = [unit for unit in ENGINE_UNITS if not any(in_engine_unit(m) == unit for m in graph)]
    assert empty == [], "these units have no module: update ENGINE_UNITS"


@pytest.mark.parametrize(
    ("module", "unit"),
    [("accel.parallel.engines", "the strategy units and registry"),
     ("accel.parallel.engines.ddp", "the strategy units and registry"),
     ("accel.parallel.deepspeed.engine", "DeepSpeed"), ("accel.parallel.fsdp_params", "FSDP2"),
     ("accel.parallel.ddp_teardown", "DDP"), ("accel.parallel.pipeline.step",
                                              "pipeline parallelism (pp)"),
     ("accel.parallel.context_parallel", "context parallelism (cp)"),
     ("accel.precision.fp8", "precision modes (fp8 is its unit)"),
     ("accel.core.mesh", "the mesh dims themselves"), ("accel.parallel.tensor_parallel", None),
     ("accel.training.model", None), ("accel.parallel", None), ("accel.core.state", None)],
)
def test_in_engine_unit(module: str, unit: str | None) -> None:
    assert in_engine_unit(module) == unit


def test_an_engine_branch_is_found() -> None:
    source = '''
"""Docstrings name engines: "deepspeed", fsdp, st.pp_world_size > 1."""
import importlib.util
import sys

def f(st, chosen, strategy, name, mesh, kind):
    if st.strategy == "deepspeed":  # 7
        pass
    ok = chosen != "fsdp" and strategy in ("none", "ddp")  # 9: two
    if "deepspeed" in sys.modules or sys.modules.get("torch.distributed.fsdp"):  # 10: two
        pass
    if st.pp_world_size > 1 or cp_size == 1 or name != "pp":  # 12
        raise ValueError(f"strategy={st.strategy!r} is not supported with fsdp")
    warn("use strategy='fsdp'", "deepspeed")
    if not importlib.util.find_spec("deepspeed") or sys.modules["torchao"]:  # 15: two
        pass
    match st.strategy:  # 17
        case "ddp":  # 18
            pass
    match kind:  # 20
        case "fp8":
            pass
    if strategy == "none" or policy["strategy"] == "none" or policy["strategy"] is None:  # 23
        pass
    if "torchao" in sys.modules:  # 25
        pass
    return (strategy is None, kind == "cpu", chosen == "none", f"{a == 'ddp'}",
            "transformers" in sys.modules, sys.modules.get("torch._dynamo"), mesh["dp"])
'''
    found = engine_branches_in(ast.parse(source))
    assert found == [
        "line 7: st.strategy == 'deepspeed'  (x.strategy)",
        "line 9: chosen != 'fsdp'  (an engine's name)",
        "line 9: strategy in ('none', 'ddp')  (an engine's name)",
        "line 10: 'deepspeed' in sys.modules  (an engine's name)",
        "line 10: sys.modules.get('torch.distributed.fsdp')  (an engine's library)",
        "line 12: cp_size == 1  (a mesh dim)",
        "line 12: name != 'pp'  (a mesh dim)",
        "line 12: st.pp_world_size > 1  (a mesh dim)",
        "line 15: importlib.util.find_spec('deepspeed')  (an engine's library)",
        "line 15: sys.modules['torchao']  (an engine's library)",
        "line 17: match st.strategy  (x.strategy)",
        "line 20: match kind  (an engine's name)",
        "line 23: policy['strategy'] == 'none'  (a strategy's name)",
        "line 23: strategy == 'none'  (a strategy's name)",
        "line 25: 'torchao' in sys.modules  (an engine's library)",
        "line 27: a == 'ddp'  (an engine's name)",  # code inside an f-string runs
    ]


if __name__ == "__main__":  # print the graph, lowest layer first, then what the checks refuse
    graph = import_graph()
    directories = directory_graph(graph, package_dirs())
    for module in sorted(graph, key=lambda m: (-layer_of(m), m)):
        deps = " ".join(sorted(graph[module])) or "-"
        print(f"[{LAYERS[layer_of(module)][0]}] {module} -> {deps}")
    for cycle in import_cycles(graph):
        print("cycle:", " ".join(cycle))
    for cycle in import_cycles(package_graph(graph)):
        print("package cycle:", " ".join(cycle))
    for cycle in import_cycles(directories):
        print("package directory cycle:", " ".join(cycle))
        print("\n".join(cycle_imports(graph, cycle, package_dirs())))
    for line in private_imports(graph) + upward_imports(graph) + private_names_used():
        print(line)
    branches = engine_branches()
    for module, found in branches.items():
        print(f"engine branch outside its unit in {module}:")
        print("\n".join(f"  {line}" for line in found))
    failed = (
        upward_imports(graph) or import_cycles(graph) or import_cycles(package_graph(graph))
        or private_imports(graph) or private_names_used() or import_cycles(directories)
        or branches
    )
    sys.exit(1 if failed else 0)

"""Imports inside accel only flow down the layers recorded in docs/architecture.md.

The import graph is drawn from the source with ``ast``: every ``import``/``from ... import``
naming an accel module, at module level or inside a function (a lazy import is a dependency
too). Run this file as a script to print the graph with each module's layer. The page also
names every module in a group; a module it does not name fails here. The graph has no cycle,
and neither has the graph of accel's packages (``accel.checkpoint``, ``accel.big_model``... and
each top-level module: one node each, an edge where a module of one imports a module of the
other). No package imports another package's ``_private`` module, and accel/ holds at most six
top-level modules.
"""

from __future__ import annotations

import ast
import re
import sys
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
        "accel.core.lazy", "accel.core.exit_refs",
    )),
    ("config file", ("accel.core.config_file",)),
    ("environment", ("accel.core.env",)),
    ("settings", ("accel.core.settings",)),
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


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each accel module and the accel modules it imports (``accel`` for the package itself).

    ``from accel import __version__`` is not counted: it reads the package's metadata, which
    is loaded before any of its modules.
    """
    paths = {_module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
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


if __name__ == "__main__":  # print the graph, lowest layer first
    graph = import_graph()
    for module in sorted(graph, key=lambda m: (-layer_of(m), m)):
        deps = " ".join(sorted(graph[module])) or "-"
        print(f"[{LAYERS[layer_of(module)][0]}] {module} -> {deps}")
    for cycle in import_cycles(graph):
        print("cycle:", " ".join(cycle))
    for cycle in import_cycles(package_graph(graph)):
        print("package cycle:", " ".join(cycle))
    for line in private_imports(graph) + upward_imports(graph):
        print(line)
    failed = (
        upward_imports(graph) or import_cycles(graph) or import_cycles(package_graph(graph))
        or private_imports(graph)
    )
    sys.exit(1 if failed else 0)

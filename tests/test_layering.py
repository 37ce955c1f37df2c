"""The import layers, read from the source with ``ast`` (no JAX, nothing imported): the mesh
layer ``sharding/`` sits under the engine and never imports ``jserve.engine``; the model and
the kernels sit under the mesh layer and never import ``sharding``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (top level, functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _violations(package: str, forbidden: str, root: Path = ROOT) -> list[str]:
    files = sorted((root / package).rglob("*.py"))
    assert files, f"no modules under {package}"
    return [f"{path.relative_to(root)} imports {name}"
            for path in files for name in sorted(_imports(path))
            if name == forbidden or name.startswith(forbidden + ".")]


@pytest.mark.parametrize("package, forbidden", [
    ("sharding", "jserve.engine"),
    ("jserve/model", "sharding"),
    ("jserve/kernels", "sharding"),
])
def test_lower_layers_do_not_import_higher_ones(package, forbidden):
    assert _violations(package, forbidden) == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    from sharding.specs import layer_spec\n")
    assert _violations("pkg", "sharding", tmp_path) == [
        "pkg/m.py imports sharding.specs", "pkg/m.py imports sharding.specs.layer_spec"]


def test_the_engine_stays_carved():
    """Issue 19's shape of the engine package: no function in ``jserve/engine/`` over 60
    lines (construction, intake, output processing and the host KV store live in their own
    modules), ``engine.py`` under 600 (issue 40's bound for every module; 300 before, which
    pushed fragments out of it)."""
    engine = ROOT / "jserve" / "engine"
    assert len((engine / "engine.py").read_text().splitlines()) < 600
    long = [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(engine.glob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


# -- the module import graph (issue 40: no import cycles, even through imports inside
# functions) ---------------------------------------------------------------------------------
GRAPH_PACKAGES = ("jserve", "sharding")


def _module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by its dotted name (a package by its own)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, at any depth (top level, functions,
    ``TYPE_CHECKING``); ``from X import Y`` is an import of ``X.Y`` where that is a module,
    else of ``X``; relative imports are resolved against ``name``'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {module for module in found if module in modules and module != name}


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = GRAPH_PACKAGES
                 ) -> dict[str, set[str]]:
    """Module -> the modules it imports, read from the source of ``packages``."""
    modules = _module_names(root, packages)
    return {name: _imported_modules(name, path, modules) for name, path in modules.items()}


def _shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import path from ``start`` back to itself (breadth first), or None."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start] + path[::-1][1:] + [start] if node != start else [start, start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    return None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The shortest cycle through each module that is on one, each cycle once (by its
    members, whatever module it starts from)."""
    cycles, seen = [], set()
    for name in sorted(graph):
        cycle = _shortest_cycle(graph, name)
        if cycle and frozenset(cycle) not in seen:
            seen.add(frozenset(cycle))
            cycles.append(cycle)
    return cycles


def test_no_import_cycles():
    """No module of ``jserve`` or ``sharding`` imports, through any chain of imports
    (including those inside functions), a module that imports it: an import inside a
    function is for keeping a heavy optional dependency off the start-up path, not for
    hiding a cycle."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)

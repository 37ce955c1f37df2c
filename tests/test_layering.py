"""The shape of the code, read from the source with ``ast`` (no JAX, nothing imported): the
import layers (the mesh layer ``sharding/`` sits under the engine and never imports
``jserve.engine``; the model and the kernels sit under the mesh layer and never import
``sharding``; nothing in ``jserve`` imports torch, transformers, matplotlib or the benchmark
harness ``scripts/harness``), no import cycle in ``jserve``, ``sharding`` and the harness
(imports inside functions count), and the size bounds of modules and functions."""
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


# -- what the package imports: jserve runs without torch, transformers and matplotlib (the
# benchmark harness that uses them, scripts/harness, stays out of the package and imports
# jserve, never the reverse) ------------------------------------------------------------------
HARNESS_ONLY = ("torch", "transformers", "matplotlib")


@pytest.mark.parametrize("forbidden", HARNESS_ONLY)
def test_the_package_imports_no_torch_transformers_or_matplotlib(forbidden):
    assert _violations("jserve", forbidden) == []


def test_the_package_does_not_import_the_harness():
    assert _violations("jserve", "harness") == []
    assert _violations("sharding", "harness") == []


def test_the_package_keeps_only_the_bench_modules_it_runs():
    """``jserve/bench`` holds what ``jserve bench serve`` (the CLI) and the simulator import:
    the command, its request sets, the replay clients and the metrics; the rest of the
    harness lives in ``scripts/harness``."""
    kept = sorted(p.stem for p in (ROOT / "jserve" / "bench").glob("*.py"))
    assert kept == ["__init__", "datasets", "metrics", "replay", "serve_bench"]
    assert (ROOT / "scripts" / "harness" / "__init__.py").exists()
    # and each is reached from outside jserve.bench (jserve.cli, jserve.sim), through other
    # bench modules or directly
    graph = import_graph()
    reached, frontier = set(), {m for name, deps in graph.items()
                                if not name.startswith("jserve.bench") for m in deps}
    while frontier:
        reached |= frontier
        frontier = {m for name in frontier for m in graph[name]} - reached
    assert sorted(m for m in graph if m.startswith("jserve.bench.") and m not in reached) == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    from sharding.specs import layer_spec\n")
    assert _violations("pkg", "sharding", tmp_path) == [
        "pkg/m.py imports sharding.specs", "pkg/m.py imports sharding.specs.layer_spec"]


# -- sizes (issue 40: no module over 600 lines, no function over 80) ------------------------
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_ENGINE_FUNCTION_LINES = 60  # issue 19's shape of jserve/engine, which still holds


def _oversized(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Every module over ``MAX_MODULE_LINES`` and every function (methods and nested ones
    too) over its bound, in ``packages`` under ``root``."""
    over = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            text, rel = path.read_text(), path.relative_to(root)
            if (n := len(text.splitlines())) > MAX_MODULE_LINES:
                over.append(f"{rel}: {n} lines (modules: {MAX_MODULE_LINES})")
            bound = (MAX_ENGINE_FUNCTION_LINES if rel.parts[:2] == ("jserve", "engine")
                     else MAX_FUNCTION_LINES)
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        (n := node.end_lineno - node.lineno + 1) > bound:
                    over.append(f"{rel}:{node.lineno} {node.name}: {n} lines "
                                f"(functions here: {bound})")
    return over


def test_modules_and_functions_stay_small():
    """No module of ``jserve``, ``sharding`` or the harness (``scripts/harness``) over 600
    lines and no function over 80 (over 60 in ``jserve/engine``, whose construction,
    intake, output processing, programs, step execution and page I/O each live in their own
    module)."""
    over = _oversized(ROOT, ("jserve", "sharding", "scripts/harness"))
    assert not over, "over the size bounds:\n" + "\n".join(over)


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
                    return path[::-1] + [start]
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


def test_the_import_graph_sees_every_kind_of_import(tmp_path):
    """Imports inside functions, ``from package import module``, relative imports and
    ``from module import name`` each make an edge; a cycle through them is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import thing\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import name\nthing = 1\n")
    (pkg / "c.py").write_text("import os\nfrom pkg import a\nname = 2\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.b"}, "pkg.a": {"pkg.sub.b"},
                     "pkg.sub.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_no_import_cycles():
    """No module of ``jserve``, ``sharding`` or ``harness`` imports, through any chain of
    imports (including those inside functions), a module that imports it: an import inside a
    function is for keeping a heavy optional dependency off the start-up path, not for
    hiding a cycle."""
    graph = {**import_graph(), **import_graph(ROOT / "scripts", ("harness",))}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# -- the engine's rooms (docs/engine.md, "Modules"): every engine module lives in the room of
# its seam; the host-only rooms import no device-side room; construction is imported by the
# loop alone; the command line is not the engine's -------------------------------------------
ENGINE_ROOMS = ("requests", "batch", "programs", "device", "loop", "build")


def _engine_room_imports() -> dict[str, set[str]]:
    """Engine room (or top module) -> the other rooms (or top modules) it imports."""
    graph, found = import_graph(), {}
    for name, deps in graph.items():
        parts = name.split(".")
        if parts[:2] != ["jserve", "engine"] or len(parts) < 3:
            continue
        found.setdefault(parts[2], set()).update(
            d.split(".")[2] for d in deps
            if d.split(".")[:2] == ["jserve", "engine"] and len(d.split(".")) > 2
            and d.split(".")[2] != parts[2])
    return found


def test_every_engine_module_lives_in_a_room():
    engine = ROOT / "jserve" / "engine"
    top = sorted(p.name for p in engine.glob("*.py"))
    assert top == ["__init__.py", "config.py", "engine.py"]
    assert sorted(p.name for p in engine.iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(ENGINE_ROOMS)


def test_the_engine_rooms_import_along_the_seams():
    rooms = _engine_room_imports()
    assert rooms["requests"] <= {"config"}
    assert rooms["batch"] <= {"config", "requests"}
    assert [room for room, deps in sorted(rooms.items()) if "build" in deps] == ["engine"]


def test_the_command_line_is_not_the_engines():
    assert _violations("jserve/engine", "argparse") == []
    assert _violations("jserve/engine", "jserve.flags") == []

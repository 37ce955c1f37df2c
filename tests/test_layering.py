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

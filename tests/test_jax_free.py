"""The scheduler and the simulator run without JAX (the design's contract: the same scheduler
drives the live engine and the simulator on a laptop), and so do their tests. A fresh process
in which importing JAX fails imports every module of ``jserve.scheduler`` and ``jserve.sim``,
collects (fast tier) or runs (full suite) their test files, and must end with JAX never
loaded."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JAX_FREE_TESTS = [f"tests/test_{name}.py" for name in (
    "scheduler", "scheduler_properties", "deadline_scheduler", "predictor_chunking", "data",
    "sim_hardware", "sim_loongserve", "sim_loongserve_rules", "sim_policies", "sim_simulator",
    "sim_trace", "sim_goodput", "routing", "sim_cluster")]

_SCRIPT = """
import importlib, pkgutil, sys

class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError(f"{name} imported where no JAX is allowed")

sys.meta_path.insert(0, NoJax())
import pytest
import jserve.routing, jserve.scheduler, jserve.sim
for pkg in (jserve.routing, jserve.scheduler, jserve.sim):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
code = pytest.main(["-n", "0", "-p", "no:cacheprovider", *sys.argv[1:]])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib"))
print("JAX modules loaded:", loaded)
sys.exit(code or bool(loaded))
"""


@pytest.mark.parametrize("extra, outcome", [
    pytest.param(["--collect-only"], " collected", id="import"),  # the fast tier: imports only
    pytest.param([], " passed", id="run", marks=pytest.mark.slow),  # the test bodies too
])
def test_scheduler_and_simulator_tests_pass_without_jax(extra, outcome):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *extra, *JAX_FREE_TESTS], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "JAX modules loaded: []" in proc.stdout
    assert outcome in proc.stdout


def test_the_cli_imports_no_jax():
    """``jserve simulate`` (and ``--help``) start without loading JAX: the CLI module reads
    ``EngineConfig`` and ``MeshConfig``, both plain Python."""
    code = ("import sys, jserve.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"

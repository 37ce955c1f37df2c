"""A wheel of jserve is self-contained: built from a copy of the repository, installed into a
fresh virtual environment in a temporary directory (nothing beside it, no ``../shared``), it
simulates a packaged trace on the packaged A100 profiles. Offline: the build uses this
environment's setuptools, and the new environment sees this one's dependencies through a
``.pth`` path line, which adds their directory but runs none of its ``.pth`` hooks, so the
editable jserve installed there cannot shadow the wheel's."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNCOPIED = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                  ".pytest_cache", ".hypothesis", "out")


def _run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          **kw)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_a_wheel_installs_alone_and_simulates(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=UNCOPIED)  # the build writes build/ and egg-info there
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("jserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("README.md", "LICENSE-vidur-MIT.txt", "LICENSE-sarathi-serve-Apache-2.0.txt",
              "traces/azure_conv_2023.csv", "profiles/network/a100_dgx/all_reduce.csv"):
        assert f"jserve/data/{f}" in names, f
    # the benchmark harness (scripts/harness) stays out of the wheel
    assert not [n for n in names if n.startswith(("harness/", "scripts/"))]
    assert sorted(n for n in names if n.startswith("jserve/bench/")) == [
        f"jserve/bench/{m}.py" for m in ("__init__", "datasets", "metrics", "replay",
                                         "serve_bench")]

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "-q", wheel)
    purelib = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"
                        ).stdout.strip())
    (purelib / "outer_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    env = {k: v for k, v in os.environ.items()
           if k not in ("JSERVE_SHARED_DATA", "PYTHONPATH", "PYTHONHOME")}
    where = json.loads(_run(python, "-c", "import json, jserve, jserve.data as d; print(json."
                            "dumps([jserve.__file__, str(d.profiles_root())]))",
                            cwd=tmp_path, env=env).stdout)
    assert all(Path(p).is_relative_to(venv) for p in where), where

    out = tmp_path / "records.jsonl"
    sim = _run(venv / "bin" / "jserve", "simulate", "--trace", "azure-conv", "--policy", "lars",
               "--model", "llama3-8b", "--hardware", "a100", "--tp", "8", "--max-requests", "40",
               "--out", out, cwd=tmp_path, env=env)
    assert "lars: 40 requests on llama3-8b a100 tp=8" in sim.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 40 and all(r["finish_reason"] == "length" for r in records)

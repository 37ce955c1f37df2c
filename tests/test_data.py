"""The packaged data (``jserve/data``): every file is named in its README with a source, the
licences ship beside them, and ``$JSERVE_SHARED_DATA`` moves the time model to other profiles."""
from __future__ import annotations

import pytest

from jserve.data import TRACES, packaged_dir, profiles_root, trace_path
from jserve.sim.hardware import GpuTimeModel


def test_every_packaged_file_is_in_the_readme_and_the_licences_ship():
    root = packaged_dir()
    readme = (root / "README.md").read_text()
    for path in sorted(root.rglob("*.csv")):
        named = path.name if path.parent.name == "traces" else path.parent.name
        assert named in readme, path
    for licence in ("LICENSE-vidur-MIT.txt", "LICENSE-sarathi-serve-Apache-2.0.txt"):
        assert (root / licence).stat().st_size > 1000 and licence in readme


def test_traces_by_name_or_path(tmp_path):
    assert {n: trace_path(n).parent for n in TRACES} == {n: packaged_dir() / "traces"
                                                         for n in TRACES}
    own = tmp_path / "sharegpt4"  # a path is a path, even one that looks like a name
    own.write_text("")
    assert trace_path(own) == own
    with pytest.raises(FileNotFoundError, match="packaged traces: sharegpt4, azure-conv"):
        trace_path(tmp_path / "missing.csv")


def test_the_environment_overrides_the_packaged_profiles(tmp_path, monkeypatch):
    monkeypatch.delenv("JSERVE_SHARED_DATA", raising=False)
    assert profiles_root() == packaged_dir()
    monkeypatch.setenv("JSERVE_SHARED_DATA", str(tmp_path))
    assert profiles_root() == tmp_path
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "profiles" / "compute")):
        GpuTimeModel("llama3-8b", "a100")

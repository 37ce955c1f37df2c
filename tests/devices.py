"""Runs a test body on N simulated CPU devices. JAX fixes its device count when it starts, so
a body that needs a mesh runs in a fresh Python process whose ``XLA_FLAGS`` force the count;
the body prints its result as JSON on its last stdout line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The suite's programs are tiny, so its time goes to compiling them. Two XLA:CPU settings
# halve that and give the same tokens (logprobs move by 1e-6; XLA:CPU reorders no float
# math without fast-math): LLVM at -O0, and the older loop emitters instead of the fusion
# emitters. The kvp engine test: 62 CPU seconds with neither, 42 with -O0, 24 with both.
# conftest.py sets them for every test process; the subprocesses inherit them.
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def xla_flags(devices: int | None = None, suite: bool = True) -> str:
    """The suite's XLA flags (``suite``; else none of them) and the caller's own, with
    ``devices`` forced CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
             and f not in SUITE_XLA_FLAGS]
    flags += list(SUITE_XLA_FLAGS) if suite else []
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def harness_env() -> dict[str, str]:
    """The environment with ``scripts/`` first on ``PYTHONPATH``: a ``python -c`` body can
    ``import harness`` as the tests do (pytest's ``pythonpath``) and the scripts do."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "scripts")] + [x for x in [os.environ.get("PYTHONPATH")] if x])}


def run_on_devices(script: str, *args: str, devices: int = 8, timeout: float = 900,
                   suite_flags: bool = True) -> subprocess.CompletedProcess:
    """Runs ``python -c script *args`` from the repository root with ``devices`` CPU devices
    (``harness`` importable); asserts it succeeded and sets ``.result`` to the JSON object it
    printed last. ``suite_flags`` False: XLA's default code generation, for a body whose time
    goes to running its programs rather than compiling them."""
    env = {**harness_env(), "XLA_FLAGS": xla_flags(devices, suite_flags)}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc.result = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc

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


def run_on_devices(script: str, *args: str, devices: int = 8,
                   timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs ``python -c script *args`` from the repository root with ``devices`` CPU devices;
    asserts it succeeded and sets ``.result`` to the JSON object it printed last."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc.result = json.loads(proc.stdout.strip().splitlines()[-1])
    return proc

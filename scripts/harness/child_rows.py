"""A measurement run in a child process that prints one JSON row a line: the device check's
HF baseline (torch never shares the process with JAX's memory pool) and its timings under
other XLA flags (XLA reads them once per process). The parent bounds it by the budget left
and keeps the rows printed before a timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def child_rows(module: str, payload: dict, timeout: float, what: str,
               env: dict[str, str] | None = None) -> list[dict]:
    """``python -m module '<payload as JSON>'`` (a ``harness`` module) with this checkout's
    jserve and harness first on the path (and ``env`` over the environment), killed after
    ``timeout`` seconds; the rows it printed. RuntimeError naming ``what`` when it printed
    none."""
    scripts = Path(__file__).resolve().parents[1]  # this harness's scripts/
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
        [str(scripts.parent), str(scripts)]  # this jserve, installed or not; ``harness``
        + [x for x in [os.environ.get("PYTHONPATH")] if x])}
    try:
        proc = subprocess.run([sys.executable, "-m", module, json.dumps(payload)],
                              capture_output=True, text=True, timeout=max(timeout, 1.0),
                              env=full_env)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, code = f"timed out after {timeout:.0f} s", None
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"{what} printed nothing (exit {code}): {err.strip()[-500:]}")
    return rows

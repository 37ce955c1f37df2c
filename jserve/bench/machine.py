"""The machine a benchmark ran on, as the benchmarks print it beside their figures."""
from __future__ import annotations

import subprocess


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

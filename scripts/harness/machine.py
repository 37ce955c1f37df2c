"""The machine a benchmark ran on, as the benchmarks print it beside their figures."""
from __future__ import annotations

import subprocess


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    import platform
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cores() -> int:
    """CPU cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

"""Multi-process serving (``sharding.distributed``): two processes with 2 CPU devices each,
joined over gloo into one tp=4 mesh, give the greedy tokens of one process with 4 devices.

tp=4 rather than 2 x 4 devices: the default model has 4 query heads, so no tp mesh covers 8
devices (and tp is the only axis implemented). Each process runs ``tests/multihost_worker.py``
under a hard timeout, so a hang fails the test instead of stalling the suite."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(coordinator: str, n: int, i: int, devices: int, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the worker sets its device count itself
    return subprocess.Popen(
        [sys.executable, "-m", "tests.multihost_worker", coordinator, str(n), str(i),
         str(devices), "tp=4", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_all(procs: list[subprocess.Popen]) -> None:
    """Waits for every process; on a timeout or a failure kills the rest and reports logs."""
    try:
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("multi-host worker timed out:\n" + "\n---\n".join(
            (p.communicate()[0] or "")[-3000:] for p in procs)) from None
    failed = [(p.returncode, log[-3000:]) for p, log in zip(procs, logs) if p.returncode]
    assert not failed, failed


def test_two_processes_match_one(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"
    multi, single = tmp_path / "multi.json", tmp_path / "single.json"
    procs = [_launch(coordinator, 2, i, 2, multi) for i in (0, 1)]
    procs.append(_launch("", 1, 0, 4, single))
    _wait_all(procs)
    m, s = json.loads(multi.read_text()), json.loads(single.read_text())
    assert (m["processes"], m["devices"], s["processes"], s["devices"]) == (2, 4, 1, 4)
    assert m["tokens"] == s["tokens"]
    assert all(len(t) == 12 for t in m["tokens"])

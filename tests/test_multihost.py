"""Multi-process serving (``sharding.distributed``): two processes joined over gloo into one
mesh give the greedy tokens of one process on one device.

Two layouts: 2 x 4 devices as spp=2 x kvp=2 x tp=2 (pipeline stages on different processes,
so activations and step buffers cross processes by ppermute; the leader broadcasts every
tick, empty drain ticks included, and every lone pass), and 2 x 2 devices as tp=4 with an
int8 KV cache on a Qwen2-MoE checkpoint (the tensor-parallel psums of attention, of the
routed experts' slices and of the shared expert cross processes). Each process
runs ``tests/multihost_worker.py`` under a hard timeout, so a hang fails the test instead of
stalling the suite."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devices import xla_flags
from multihost_worker import CONSTRAINT, TIMEOUT

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(coordinator: str, n: int, i: int, devices: int, mesh: str,
            out: Path, kv_cache_dtype: str, model: str) -> subprocess.Popen:
    # The worker sets its device count itself.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags()}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.multihost_worker", coordinator, str(n), str(i),
         str(devices), mesh, str(out), kv_cache_dtype, model],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_all(procs: list[subprocess.Popen]) -> None:
    """Waits for every process; on a timeout or a failure kills the rest and reports logs."""
    try:
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("multi-host worker timed out:\n" + "\n---\n".join(
            (p.communicate()[0] or "")[-8000:] for p in procs)) from None
    failed = [(p.returncode, log[-3000:]) for p, log in zip(procs, logs) if p.returncode]
    assert not failed, failed


@pytest.mark.parametrize("devices, mesh, kv_cache_dtype, model", [
    (4, "spp=2,kvp=2,tp=2", "auto", "default"),
    # An MoE model on int8 pages, ep across the two processes (the outer mesh axis) and tp
    # within each: the experts' psum over ep crosses processes, tp's (attention, the shared
    # expert, the experts' slices) stays in one (as the first case's tp; its spp and kvp
    # cross).
    (2, "ep=2,tp=2", "int8", "qwen2_moe-4heads")])
def test_two_processes_match_one_device(tmp_path, devices, mesh, kv_cache_dtype, model):
    if model != "default":
        from hf_models import tiny_llama_dir
        model = str(tiny_llama_dir(model, with_tokenizer=True))  # for the constrained request
    coordinator = f"127.0.0.1:{_free_port()}"
    multi, single = tmp_path / "multi.json", tmp_path / "single.json"
    procs = [_launch(coordinator, 2, i, devices, mesh, multi, kv_cache_dtype, model)
             for i in (0, 1)]
    procs.append(_launch("", 1, 0, 1, "tp=1", single, kv_cache_dtype, model))
    _wait_all(procs)
    m, s = json.loads(multi.read_text()), json.loads(single.read_text())
    assert (m["processes"], m["devices"], s["processes"], s["devices"]) == (2, 2 * devices, 1, 1)
    assert m["tokens"] == s["tokens"]
    assert all(len(t) == 12 for t in m["tokens"])
    # Under spp the decodes that end the run are batches alone in the pipeline: passes,
    # whose header and one-step buffers the followers must replay.
    assert (m["passes"] > 0) == ("spp" in mesh), m["passes"]
    # Exactly the steps that sample the constrained request's tokens broadcast a bitmask
    # (one per token: several processes mask in the step, no bursts; one process: nothing
    # to send), and its greedy tokens are the one-process run's, which masks them after
    # the forward.
    assert m["constrained"] == s["constrained"] and re.fullmatch(CONSTRAINT, m["text"])
    assert (m["masked_steps"], s["masked_steps"]) == (len(m["constrained"][0]), 0), m

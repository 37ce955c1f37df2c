"""Shared fixtures. This module imports no JAX, so the scheduler and simulator tests run
without it (tests/test_jax_free.py holds this); engine helpers live in tests/llm_helpers.py
and load only where a test uses them."""
from __future__ import annotations

import gc
import os
import sys

import pytest

from devices import xla_flags
from harness.served import SERVE_FLAGS, Served  # noqa: F401  (the tests import them from here)

os.environ["XLA_FLAGS"] = xla_flags(None)  # before any test imports JAX (devices.py says why)
# The CPU is the suite's platform. With the accelerator plugins installed (the compile-only
# GPU and TPU targets, jserve.targets) JAX would otherwise try each at start in every
# process, and libtpu prints warnings; their topologies still answer with this set.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# The files that take minutes (mesh subprocesses, real tools, many engines), longest first:
# collected first, so each of the two workers (``--dist loadfile``) starts on one and the
# run does not end with one worker alone in a long file while the other idles. (xdist 3.8's
# default ``--loadscope-reorder`` then sorts the files by their number of tests, which undoes
# most of this order: the long files, few tests each, run last. ``--no-loadscope-reorder``
# was tried on 2026-12-03 and put the Ray app beside the target compiles at the start, where
# two of its tests timed out on an overloaded host; it is not on.)
LONG_FILES = ("test_target_steps.py", "test_targets.py", "test_mesh_matrix.py",
              "test_model_families.py", "test_moe.py", "test_kv_quant_engine.py",
              "test_multihost.py", "test_ray_app.py", "test_quantized_tiny_tasks.py",
              "test_speculative_engine.py", "test_prefix_cache_engine.py",
              "test_weight_quant.py", "test_hf_parity.py", "test_prompt_logprobs.py",
              "test_device_check.py", "test_engine_lifecycle.py", "test_kvp_engine.py",
              "test_long_prefill_live.py", "test_speculative_mesh.py", "test_spp_engine.py",
              "test_lora.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as found


@pytest.fixture(scope="module")
def llm():
    from llm_helpers import small_llm
    return small_llm()


def apply_plan(scheduler, plan, sample_token: int = 5) -> None:
    """Hand a scheduled plan back as the engine does after its step, with ``sample_token``
    for every chunk that samples."""
    if not plan.is_empty:
        n = sum(c.samples for c in plan.decodes + plan.prefills)
        scheduler.update(plan, [sample_token] * n)


@pytest.fixture(scope="module", autouse=True)
def _free_executables():
    """JAX's caches keep every compiled step executable (about 400 memory maps each on CPU)
    after its LLM is gone; a whole-suite process would otherwise pass vm.max_map_count (65530)
    and segfault mid-run. Dropping them after each module keeps the count bounded (there is
    nothing to drop in a process that never imported JAX)."""
    yield
    if "jax" in sys.modules:
        gc.collect()
        sys.modules["jax"].clear_caches()


def gauges(url: str, token: str | None = None) -> dict[str, float]:
    """A server's /metrics as {name + labels: value}."""
    import json

    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families
    headers = {"authorization": f"Bearer {token}"} if token else {}
    body = httpx.get(url + "/metrics", timeout=10, headers=headers).text
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")] = s.value
    return out


def wait_blocks_free(url: str, token: str | None = None, timeout: float = 30.0) -> dict:
    """Waits until a server holds no KV page and runs and queues nothing; its gauges."""
    import time
    end = time.monotonic() + timeout
    while True:
        g = gauges(url, token)
        if g["jserve_kv_blocks_used"] == 0 and g["jserve_num_requests_running"] == 0 \
                and g["jserve_num_requests_waiting"] == 0:
            return g
        assert time.monotonic() < end, {k: v for k, v in g.items() if "blocks" in k}
        time.sleep(0.05)


def wait_idle(bg, timeout: float = 30.0) -> dict:
    """Waits until nothing is in flight on ``bg`` (a ``BackgroundServer``): no request, no
    plan on the device, no handler; then asserts the page pool is whole."""
    import time
    end = time.monotonic() + timeout
    while True:
        st = bg.stats()  # allocator.check() runs on the engine thread
        # ... and every handler has ended (and counted its outcome) on the event loop: each
        # gRPC call's, accepted or not, and each accepted HTTP request's. (A gRPC call grpc
        # has not handed to its handler yet is in none of these: an answer to a later call
        # on the same channel says the earlier ones were handed over, or dropped.)
        if st["in_flight"] == 0 and st["engine_requests"] == 0 and not st["engine_busy"] \
                and bg.server.gateway.in_flight == 0 and bg.server.calls_in_flight == 0:
            break
        assert time.monotonic() < end, f"requests still in flight: {st}"
        time.sleep(0.02)
    assert st["waiting"] == st["running"] == 0, st
    assert st["pages_used"] == 0 and st["pages_free"] == st["pages_total"], st
    return st

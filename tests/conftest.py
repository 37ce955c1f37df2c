"""Shared fixtures. This module imports no JAX, so the scheduler and simulator tests run
without it (tests/test_jax_free.py holds this); engine helpers live in tests/llm_helpers.py
and load only where a test uses them."""
from __future__ import annotations

import gc
import sys

import pytest


@pytest.fixture(scope="module")
def llm():
    from llm_helpers import small_llm
    return small_llm()


def apply_plan(scheduler, plan, sample_token: int = 5) -> None:
    """Apply a plan to pure-scheduler requests as the engine would: advance computed counts
    and append a sampled token for every chunk that samples."""
    by_id = {r.request_id: r for r in scheduler.running}
    for c in plan.decodes + plan.prefills:
        r = by_id[c.request_id]
        r.num_computed += c.num_tokens
        if c.samples:
            r.token_ids.append(sample_token)


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

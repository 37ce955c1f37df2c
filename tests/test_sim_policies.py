"""Every simulated policy below the time model's saturation: outcomes are a function of the
seed, every request completes, and the KV pool ends as it began (blocks conserved)."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from harness.workload import WorkloadSpec, build_workload
from jserve.scheduler.registry import SIMULATED_POLICIES as POLICIES
from jserve.sim.loongserve import simulate_loongserve, tipping_point_s
from jserve.sim.loongserve_manager import GlobalManager
from jserve.sim.policies import (
    SimConfig,
    _max_context,
    build,
    esp_costs,
    esp_instances,
    saturation,
)
from jserve.sim.simulator import VirtualClock, simulate

CFG = SimConfig(model="llama3-8b", hardware="a100", tp=8, spp=2)


@functools.lru_cache(maxsize=2)
def trace(seed: int):
    """30 requests, 2 of them long (scaled to 32K-256K tokens so the runs take seconds),
    Poisson at half the slowest policy's saturation QPS."""
    spec = WorkloadSpec(num_requests=30, long_fraction=0.07, qps=1.0, long_scale=1 / 4,
                        seed=seed)
    lengths = build_workload(spec)
    qps = 0.5 * min(saturation(lengths, p, CFG) for p in POLICIES)
    return build_workload(dataclasses.replace(spec, qps=qps))


def run_checked(policy: str, seed: int) -> list[dict]:
    t = trace(seed)
    if policy == "loongserve":
        costs = esp_costs(CFG)
        gm = GlobalManager(esp_instances(CFG), costs.capacity_tokens(CFG.memory_fraction),
                           costs, tipping_s=tipping_point_s(costs))
        recs = simulate_loongserve(t, costs, gm.n, manager=gm, check=True)
        assert sum(gm.used) == 0 and gm.placement == {}
        return recs
    clock = VirtualClock()
    sched, predictor = build(policy, CFG, clock, _max_context(t))
    total = sched.allocator.num_free
    recs = simulate(sched, predictor, clock, t, policy)
    sched.allocator.check()
    assert sched.allocator.num_free == total and sched.allocator.num_allocated == 0
    assert not sched.has_unfinished()
    return recs


@pytest.mark.parametrize("policy", POLICIES)
def test_below_saturation_every_request_completes_and_kv_is_conserved(policy):
    recs = run_checked(policy, seed=0)
    assert sum(r["prompt_tokens"] >= 32_768 for r in recs) == 2
    for r, t in zip(recs, trace(0)):
        assert r["finish_reason"] == "length" and r["output_tokens"] == t.output_tokens
        assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"]


@pytest.mark.parametrize("policy", POLICIES)
def test_outcomes_are_deterministic_for_a_seed(policy):
    a, b = run_checked(policy, seed=1), run_checked(policy, seed=1)
    assert a == b
    other = run_checked(policy, seed=0)
    assert [r["first_token_s"] for r in other] != [r["first_token_s"] for r in a]


def test_an_explicit_kv_pool_replaces_the_one_memory_leaves():
    """``SimConfig.kv_cache_tokens`` (the pooled replica of scripts/bench_routing.py holds
    four replicas' KV) sizes the pool; None keeps what memory_fraction leaves."""
    t = trace(0)
    default, _ = build("lars-ss", CFG, VirtualClock(), _max_context(t))
    tokens = 4 * default.allocator.total * CFG.page_size
    big, _ = build("lars-ss", dataclasses.replace(CFG, kv_cache_tokens=tokens), VirtualClock(),
                   _max_context(t))
    assert big.allocator.total == 4 * default.allocator.total


def test_a_missed_request_counts_as_behind_documents_only_if_every_replica_had_one():
    """bench_routing's diagnostic: a short request that missed while every replica had a
    document between arrival and first token could not have been routed around one."""
    from harness.routing_sim import long_everywhere_share
    doc = lambda k, a, f: dict(replica=k, prompt_tokens=200_000, arrival_s=a,  # noqa: E731
                               first_token_s=f)
    short = lambda k, a: dict(replica=k, prompt_tokens=100, arrival_s=a,  # noqa: E731
                              first_token_s=a + 9.0)
    recs = [doc(0, 0.0, 10.0), doc(1, 5.0, 8.0), doc(1, 12.0, None)]
    missed = [short(0, 6.0), short(1, 9.0), short(0, 13.0)]  # both, only r0, only r1
    share = long_everywhere_share(recs + missed, missed, 32_768, replicas=2)
    assert share == 1 / 3
    # A replica that never had a document: nothing was unavoidable.
    assert long_everywhere_share(recs + missed, missed, 32_768, replicas=3) == 0.0

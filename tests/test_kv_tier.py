"""The prefix cache's host tier: evicted prefix pages go to a bounded host pool and come back
by copy. Greedy tokens identical to a roomy device pool while pages go device -> host ->
device several times, pages conserved on both tiers after every step, a host pool too small
degrading to recompute, the issue's scenario (six long documents through a pool for two,
then the first again: restored, not recomputed), ngram speculative decoding over restored
pages, LRU order on the host (a sequence's tail before its head) and lars pricing a
host-tier document by its restore time."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from devices import run_on_devices
from jserve import SamplingParams
from jserve.cache.allocator import PageAllocator
from jserve.cache.host_tier import HostTier
from jserve.copy_rate import CopyRate
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request
from jserve.sim import VirtualClock
from llm_helpers import check_blocks, small_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
rng = np.random.default_rng(3)
DOCS = [rng.integers(0, 256, 100).tolist() for _ in range(3)]
# A, B, C, then each again twice: every repeat finds its document only on the host.
PROMPTS = [DOCS[i % 3] + [7, i] for i in range(7)]
PAGE_BYTES = 2 * 4 * 2 * 16 * 64 * 4  # default model: 4 layers x 2 KV heads x 64 x f32, K, V
# 10 usable pages: one 106-token request (7 pages) at a time, so each document's 6 full
# cached pages are evicted by the next two.
TINY = dict(num_kv_pages=11, max_model_len=160)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def reference():
    roomy = small_llm(num_kv_pages=64, max_model_len=160)
    return [o.token_ids for o in roomy.generate(PROMPTS, GREEDY)]


def _run_in_turn(eng, prompts, params=GREEDY):
    """Each prompt once the last has finished; both tiers checked after every step."""
    outs, reqs = [], []
    for p in prompts:
        rid = eng.add_request(p, params)
        reqs.append(eng.requests[rid])
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.finished]
            check_blocks(eng)
            eng.allocator.host.check()
    assert eng.allocator.num_allocated == 0
    return outs, reqs


@pytest.mark.slow
@pytest.mark.parametrize("host_pages", [40, 3])
def test_round_trips_through_the_host_give_identical_greedy_tokens(host_pages, reference):
    eng = small_llm(kv_offload_bytes=host_pages * PAGE_BYTES, **TINY).engine
    host = eng.allocator.host
    assert host.capacity == host_pages and eng.kv_tier is not None
    outs, reqs = _run_in_turn(eng, PROMPTS)
    assert [o.token_ids for o in outs] == reference
    cached = [o.metrics.cached_tokens for o in outs]
    restored = [o.metrics.restored_tokens for o in outs]
    if host_pages == 40:
        # Every repeat takes its document's 6 full pages (96 tokens) back from the host; each
        # page was copied out once (the tier keeps its copy) and in twice (A) or once.
        assert cached == restored == [0, 0, 0, 96, 96, 96, 96]
        assert host.num_offloaded == eng.kv_tier.offloaded_pages == 18
        assert host.num_restored == eng.kv_tier.restored_pages == 24
        assert eng.scheduler.prefix_host_hit_tokens == 4 * 96
        assert host.num_evictions == 0
        _check_metrics(eng)
    else:  # too small for a document: what it still holds of one comes back (3 pages at
        # most; here none: a document's head is pushed out by the next one's tail), and
        # the rest is prefilled again
        assert restored == [0] * 7
        assert host.num_evictions > 0 and host.num_used == 3
        assert eng.scheduler.prefix_host_hit_tokens == sum(restored)


@pytest.mark.slow
def test_speculative_decoding_drafts_over_restored_pages():
    """ngram drafts on the tiny-tasks model (its count-downs repeat the prompt) while three
    documents go to the host and back: greedy tokens as a roomy pool's without drafts,
    drafts made and accepted, the repeats' pages restored, both tiers conserved."""
    from jserve.cache.pool import kv_bytes_per_page

    docs = [f"count down from {n}\n" + " ".join(str(k) for k in range(n, n - 25, -1))
            for n in (90, 70, 50)]
    prompts = [docs[i % 3] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = small_llm("tiny-tasks", num_kv_pages=64, max_model_len=160)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    page = kv_bytes_per_page(roomy.engine.model_config, 16)
    eng = small_llm("tiny-tasks", num_kv_pages=11, max_model_len=160,
                    kv_offload_bytes=40 * page, speculative_config=NGRAM).engine
    outs, _ = _run_in_turn(eng, prompts, params)
    assert [o.token_ids for o in outs] == want
    assert eng.scheduler.num_accepted_tokens > 0
    assert [o.metrics.restored_tokens > 0 for o in outs] == [False] * 3 + [True] * 2


@pytest.mark.slow
def test_tp_and_kvp_shards_spill_and_restore_their_pages(reference):
    """tp=2 x kvp=2 (4 CPU devices): each shard's part of a page (its KV head, its group's
    pool) goes to the host page and back; greedy tokens as the roomy single device's, pages
    conserved on both tiers after every step."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "tests")
        import test_kv_tier as t
        from llm_helpers import small_llm
        eng = small_llm(mesh="tp=2,kvp=2", num_kv_pages=8, max_model_len=160,
                        kv_offload_bytes=40 * t.PAGE_BYTES).engine
        outs, _ = t._run_in_turn(eng, t.PROMPTS)
        print(json.dumps({"out": [o.token_ids for o in outs],
                          "restored": [o.metrics.restored_tokens for o in outs],
                          "pages": eng.kv_tier.restored_pages}))
    """)
    res = run_on_devices(script, devices=4).result
    assert res["out"] == reference
    assert res["restored"] == [0, 0, 0, 96, 96, 96, 96] and res["pages"] == 24


def _check_metrics(eng) -> None:
    """The tier's totals on a scrape, under jserve's names and vLLM's."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from jserve.serving.metrics import ServerMetrics
    from jserve.serving.router_endpoints import export_vllm_names

    metrics = ServerMetrics()
    metrics.watch_kv_tier(lambda: eng.kv_tier.stats(eng.scheduler))
    export_vllm_names(metrics, "m")
    got = {(s.name, s.labels.get("tier") or s.labels.get("direction")): s.value
           for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
           for s in f.samples}
    assert got[("jserve_prefix_cache_tier_hit_tokens_total", "host")] == 4 * 96
    assert got[("jserve_prefix_cache_tier_hit_tokens_total", "device")] == 0
    assert got[("jserve_kv_offload_pages_total", "device_to_host")] == 18
    assert got[("jserve_kv_offload_bytes_total", "host_to_device")] == 24 * PAGE_BYTES
    assert got[("jserve_kv_host_blocks_used", None)] == 18
    assert got[("jserve_kv_host_blocks_total", None)] == 40
    assert got[("jserve_kv_restore_seconds_total", None)] > 0
    assert got[("vllm:external_prefix_cache_hits_total", None)] == 4 * 96
    assert got[("vllm:external_prefix_cache_queries_total", None)] == 7 * 102
    assert got[("vllm:cpu_cache_usage_perc", None)] == 18 / 40


def test_tier_off_by_default_and_spills_as_stored_per_leaf():
    """No tier unless asked; with int8 pages the host slots hold values and scales as the
    device stores them (one host leaf per cache leaf, the page axis resized)."""
    import argparse

    from jserve.flags.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["kv_offload_bytes"] == 0
    assert engine_kwargs(parser.parse_args(["--kv-offload-bytes", "65536"]))[
        "kv_offload_bytes"] == 65536
    eng = small_llm(**TINY).engine
    assert eng.kv_tier is None and eng.allocator.host is None
    eng = small_llm(kv_offload_bytes=5 * PAGE_BYTES, kv_cache_dtype="int8", **TINY).engine
    host, device = (jax_leaves(eng.kv_tier.slots), jax_leaves(eng.runner.kv_cache))
    assert len(host) == len(device) == 4  # K and V values, K and V scales
    for h, d in zip(host, device):  # slot first: [slots, layers, heads, page, dim]
        assert h.dtype == d.dtype and h.shape[0] == eng.allocator.host.capacity
        assert h.shape[1:] == d.shape[:2] + d.shape[3:]


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


@pytest.mark.slow
def test_a_long_document_evicted_from_a_two_document_pool_comes_back_from_the_host():
    """The issue's scenario, its mechanism exactly (the timing is scripts/bench_kv_tier.py's):
    six 1,500-token documents through a pool for about two, then the first again."""
    from harness.kv_tier import ask_in_turn, document_prompts

    docs = document_prompts(6, 1500)
    settings = dict(num_kv_pages=2 * 94 + 4, max_model_len=1536, max_num_batched_tokens=512)
    rows = {}
    for tier in (False, True):
        llm = small_llm(kv_offload_bytes=(64 << 20) if tier else 0, **settings)
        rows[tier] = ask_in_turn(llm, docs + docs[:1])
        llm.engine.allocator.check()
    full = (1500 - 1) // 16 * 16  # every full page but the one holding the last token
    assert [r["cached"] for r in rows[False]] == [0] * 7
    assert [r["cached"] for r in rows[True]] == [0] * 6 + [full]
    assert [r["restored"] for r in rows[True]] == [0] * 6 + [full]
    assert rows[True][6]["computed"] == 1500 - full == 12
    assert rows[False][6]["computed"] == 1500


def test_host_lru_evicts_a_sequence_tail_before_its_head_and_never_a_pinned_slot():
    host = HostTier(4)
    for key, block in zip("dcba", (14, 13, 12, 11)):  # the device evicts tails first
        host.spill(key, block)
    assert host.lookup("abcdx") == [3, 2, 1, 0] and host.take_moves()[0] == (
        (14, 0), (13, 1), (12, 2), (11, 3))
    host.spill("e", 15)  # full: the LRU page, d (the tail), goes
    assert host.lookup("abcd") == [3, 2, 1] and host.num_evictions == 1
    host.pin([3, 2])  # a restore reads a and b: they are never evicted under it
    host.spill("f", 16)
    host.spill("g", 17)
    assert host.lookup("ab") == [3, 2] and host.lookup("c") == host.lookup("e") == []
    host.spill("h", 18)  # everything else pinned or new: the oldest unpinned (f) goes
    assert host.lookup("f") == [] and host.num_dropped == 0
    host.check()
    # e and f were evicted before this plan's copies ran: their copies are dropped.
    assert host.take_moves()[0] == ((17, 0), (18, 1))
    host.spill("a", 19)  # already held: only touched, nothing copied
    assert host.take_moves() == ((), ())
    host.check()


def _lars(restore_s_per_page: float) -> tuple[DeadlineScheduler, list[Request]]:
    """Three prompts, the same deadline (3 s) and 1 ms of prefill a token: "device" asks
    about a document cached on the device, "host" about one only the host tier holds (500
    pages), "plain" is a fresh 2,000-token prompt."""
    predictor = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))
    alloc = PageAllocator(2001, 16, prefix_caching=True)
    alloc.host = HostTier(600)
    sched = DeadlineScheduler(
        alloc, policy="lars", predictor=predictor,
        prefill_cache=PrefillTimeCache(predictor, 20_000, 0.05), max_num_seqs=8,
        max_num_batched_tokens=64, max_prefill_seqs=1, clock=VirtualClock(0.0),
        config=DeadlineConfig(t_target=0.05, chunk_granularity=16, long_threshold=10**6,
                              quick_first=0.0))
    sched.restore_seconds = lambda pages: pages * restore_s_per_page
    on_host, on_device = [5] * 8000, [6] * 8000
    for doc in (on_host, on_device):
        owner = Request("owner", doc, 1, 0.0)
        owner.page_ids = alloc.allocate(500)
        sched.advance(owner, 8000)
        alloc.free(owner.page_ids)
        if doc is on_host:  # every page needed: the idle document is evicted to the host
            alloc.free(alloc.allocate(2000))
            assert len(alloc.host.take_moves()[0]) == 500 and alloc.num_cached == 0
    reqs = [Request("device", on_device + [1] * 16, 1, 0.0),
            Request("host", on_host + [1] * 16, 1, 0.0), Request("plain", [2] * 2000, 1, 0.0)]
    for r in reqs:
        r.ttft_deadline = 3.0
        sched.add(r)
    return sched, reqs


def test_lars_prices_a_host_tier_document_by_its_restore_time():
    # A fast link, 2 ms a page: "host" has 0.016 s of prefill plus 1 s of restore, slack
    # 1.98 s, so relative slack 1.95 against plain's 0.5: plain first. Counted as a full
    # prefill (8 s) it would be late and go first; counted as free it would be "device".
    sched, (device, host, plain) = _lars(2e-3)
    assert (host.cached_hint, host.restore_hint, device.restore_hint) == (8000, 500, 0)
    assert sched.remaining_work(host) == pytest.approx(0.016 + 1.0)
    assert sched.remaining_work(device) == pytest.approx(0.016)
    assert sched.key(plain, 0.0) < sched.key(host, 0.0) < sched.key(device, 0.0)
    # Its default TTFT deadline counts the restore too: max(1.5 x (0.016 + 1.0), 0.5).
    again = Request("again", [5] * 8000 + [3] * 16, 1, 1.0)
    sched.add(again)
    assert (again.restore_hint, again.ttft_deadline) == (500, pytest.approx(2.524))
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefills] == ["plain"] and not plan.restore
    # A slow link, 5 ms a page: 2.5 s of restore leave "host" 0.48 s of slack over 2.52 s
    # of work (0.19): it goes first, and its plan carries the 500 copies back.
    sched, (device, host, plain) = _lars(5e-3)
    assert sched.key(host, 0.0) < sched.key(plain, 0.0)
    plan = sched.schedule()
    assert [c.request_id for c in plan.prefills] == ["host"]
    assert plan.prefills[0].start == 8000 and len(plan.restore) == 500
    assert [b for _, b in plan.restore] == host.page_ids[:500]
    assert host.num_restored_tokens == host.num_cached_tokens == 8000
    assert sched.prefix_host_hit_tokens == 8000
    sched.allocator.check()
    sched.allocator.host.check()


def test_copy_rate_learns_the_link():
    rate = CopyRate(1e9, latency_s=1e-4)
    assert rate.seconds(0) == 0.0 and rate.seconds(10**9) == pytest.approx(1.0001)
    rate.observe(10**8, 0.4001)  # 0.25 GB/s measured: the first sample replaces the guess
    assert rate.bytes_per_s == pytest.approx(2.5e8)
    rate.observe(10**8, 0.2001)  # 0.5 GB/s: moved a fifth of the way
    assert rate.bytes_per_s == pytest.approx(0.8 * 2.5e8 + 0.2 * 5e8)


def test_simulator_restores_a_document_from_the_host_at_the_link_rate():
    """A 64K-token document asked twice with another between, through a device pool for
    about one: the second ask is restored (every full page, priced and charged at the host
    link's rate: its TTFT is that copy plus one chunk) with the tier, prefilled again
    without it."""
    from jserve.sim.policies import SimConfig, run_with_scheduler
    from jserve.sim.trace import TraceRequest

    doc = 65_536
    trace = [TraceRequest("a0", 0.0, doc + 64, 4, prefix_id="a", prefix_tokens=doc),
             TraceRequest("b", 30.0, doc + 64, 4, prefix_id="b", prefix_tokens=doc),
             TraceRequest("a1", 60.0, doc + 64, 4, prefix_id="a", prefix_tokens=doc)]
    got = {}
    for host in (0, 200_000):
        cfg = SimConfig(tp=8, prefix_caching=True, kv_cache_tokens=100_000,
                        host_tier_tokens=host, host_gb_per_s=10.0)
        records, sched = run_with_scheduler(trace, "lars", cfg)
        ttft = {r["request_id"]: r["first_token_s"] - r["arrival_s"] for r in records}
        got[host] = (ttft, sched.prefix_host_hit_tokens, sched.prefix_hit_tokens)
    (off, off_host, off_hits), (on, on_host, on_hits) = got[0], got[200_000]
    # b evicted a's tail (a tail goes first); its head is still on the device either way.
    assert off_host == 0 and off_hits == on_hits - on_host > 0
    assert on_hits == doc  # the whole document (the question is its own)
    # The host part x 16 KiB of one token's KV on one GPU (Llama-3 8B, TP8) at 10 GB/s.
    copy = on_host * 2 * 32 * 1 * 128 * 2 / 10e9
    assert on["a1"] >= copy and on["a1"] < off["a1"] / 4 and on["a0"] == off["a0"]

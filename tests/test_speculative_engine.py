"""Speculative decoding in the engine (docs/speculative.md): greedy outputs identical with
and without n-gram drafts, in decode-only and mixed batches, under recompute and swap
preemption and with prefix caching; KV pages conserved after every step (rejected drafts
roll back); stop strings, stop ids, max_tokens and logprobs as without speculation; a
request that opts out or whose drafts keep failing stops speculating."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jserve import SamplingParams
from llm_helpers import check_blocks, small_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
MODEL = "tiny-tasks"  # counts down and lists fruits: text that partly repeats itself
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
# Shared leading pages (prefix caching); the long prompt takes several 32-token chunks
# beside the others' decodes (mixed batches); the last one ends on EOS.
PROMPTS = ["count down from 40", "count down from 33", "list fruits", "count down from 9",
           "list fruits, then count down from 50 " * 3]
TINY_POOL = dict(num_kv_pages=11, max_model_len=160)  # 10 usable pages of 16 tokens


def _drive(eng, prompts, params):
    """Runs to completion checking blocks after every step; returns final outputs in
    prompt order and every output streamed (to check nothing follows a finish)."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    eng.step_log = []
    final, streamed = {}, {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id not in final, "output after the request finished"
            streamed[o.request_id].append(o)
            if o.finished:
                final[o.request_id] = o
        check_blocks(eng)
    assert eng.allocator.num_allocated == 0
    return [final[i] for i in ids]


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert (g.logprobs is None) == (w.logprobs is None)
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose([a.logprob] + [v for _, v in a.top],
                                       [b.logprob] + [v for _, v in b.top], atol=1e-4)


@pytest.fixture(scope="module")
def reference():
    """Greedy runs without speculation: plain, and with a stop string / stop id / logprobs
    taken from the plain run so they are hit mid-generation."""
    llm = small_llm(MODEL)
    plain = _drive(llm.engine, PROMPTS, [GREEDY] * len(PROMPTS))
    kinds = [dataclasses.replace(GREEDY, logprobs=2),
             dataclasses.replace(GREEDY, stop=["27 2"]),
             dataclasses.replace(GREEDY, stop_token_ids=[ord("\n")], min_tokens=2),
             GREEDY, dataclasses.replace(GREEDY, max_tokens=5)]
    return plain, kinds, _drive(llm.engine, PROMPTS, kinds)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["roomy", "recompute", "swap"])
def test_greedy_is_identical_with_ngram_drafts(reference, pool):
    settings = {"roomy": {}, "recompute": dict(preemption="recompute", **TINY_POOL),
                "swap": dict(preemption="swap", **TINY_POOL)}[pool]
    plain, kinds, mixed = reference
    llm = small_llm(MODEL, speculative_config=NGRAM, **settings)
    eng = llm.engine
    # (The preempting runs give the roomy run's tokens: the engine holds that without
    # speculation, tests/test_async_scheduling.py.)
    _same(_drive(eng, PROMPTS, [GREEDY] * len(PROMPTS)), plain)
    sched = eng.scheduler
    # Drafts were verified, some accepted and some rejected, beside prefill chunks.
    assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    assert any(p.num_draft_tokens and p.prefills for p, _ in eng.step_log)
    assert sched.prefix_hit_tokens > 0
    if pool != "roomy":
        assert sched.num_preemptions > 0
        assert (sched.num_swaps > 0) == (pool == "swap")
        return
    assert sched.num_preemptions == 0
    out = _drive(eng, PROMPTS, kinds)
    _same(out, mixed)
    # A stop string ends the text before it, a stop id ends it, max_tokens is exact.
    assert out[1].finish_reason == "stop" and out[1].text.endswith(" 28 ")
    assert out[2].finish_reason == "stop" and out[2].token_ids[-1] == ord("\n")
    assert len(out[4].token_ids) == 5 and out[4].finish_reason == "length"
    assert len(out[0].token_ids) == 40 and len(out[0].logprobs) == 40


@pytest.mark.slow
def test_opt_out_and_failing_drafts_pause_speculating():
    """A request with ``speculative=False`` never drafts; one whose drafts fail (with
    min_acceptance_rate=1 any rejection fails a window) pauses for at least a window of
    output tokens, decoding plainly (and overlapping) meanwhile."""
    llm = small_llm(MODEL, speculative_config={**NGRAM, "min_acceptance_rate": 1.0,
                                               "acceptance_window": 6})
    eng = llm.engine
    off = dataclasses.replace(GREEDY, speculative=False)
    ids = [eng.add_request(PROMPTS[0], off), eng.add_request(PROMPTS[2], GREEDY)]
    reqs = {i: eng.requests[i] for i in ids}
    eng.step_log = []
    while eng.has_unfinished():
        eng.step()
    decodes = {i: [c for p, _ in eng.step_log for c in p.decodes if c.request_id == i]
               for i in ids}
    assert not any(c.drafts for c in decodes[ids[0]])
    r = reqs[ids[1]]
    assert r.num_accepted < r.num_drafted
    drafting = [bool(c.drafts) for c in decodes[ids[1]]]
    first = drafting.index(True)
    run, longest = 0, 0
    for d in drafting[first:]:
        run = 0 if d else run + 1
        longest = max(longest, run)
    assert longest >= 6  # a pause of a window's worth of plain decodes


@pytest.mark.slow
def test_logit_bias_holds_with_ngram_drafts():
    """Drafts are verified against the biased distribution (``logit_bias`` is applied in the
    sampler each verifying row runs), so speculating gives plain decoding's tokens under a
    bias too, though the n-gram proposer is blind to it."""
    biased = dataclasses.replace(GREEDY, logit_bias={ord("3"): -100, ord("9"): 2.0})
    want = _drive(small_llm(MODEL).engine, PROMPTS[:2], [biased] * 2)
    assert all(ord("3") not in o.token_ids for o in want)
    llm = small_llm(MODEL, speculative_config=NGRAM)
    _same(_drive(llm.engine, PROMPTS[:2], [biased] * 2), want)
    assert llm.engine.scheduler.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["tiny-tasks", "default"])
def test_greedy_is_identical_with_a_draft_model(reference, draft):
    """A draft model with the target's vocabulary: the target itself (its drafts are what
    the target would say: nearly all accepted) and the random default model (nearly none)."""
    plain, _, _ = reference
    llm = small_llm(MODEL, speculative_config={"method": "draft_model", "model": draft,
                                               "num_speculative_tokens": 3})
    eng = llm.engine
    _same(_drive(eng, PROMPTS, [GREEDY] * len(PROMPTS)), plain)
    sched = eng.scheduler
    assert sched.num_draft_tokens > 0
    rate = sched.num_accepted_tokens / sched.num_draft_tokens
    assert rate > 0.9 if draft == "tiny-tasks" else rate < 0.5
    assert eng.speculator.draft.engine.allocator.num_allocated == 0  # its own pool, all free


@pytest.mark.slow
def test_sampled_requests_speculate_reproducibly_and_metrics_count_drafts():
    """A seeded sampled request verifies drafts by rejection sampling: the same seed gives
    the same tokens again; max_tokens is exact. Drafts show in the per-request metrics, in
    ``Speculator.stats`` and in the Prometheus collector."""
    from prometheus_client import generate_latest

    from jserve.serving.metrics import ServerMetrics
    llm = small_llm(MODEL, speculative_config=NGRAM)
    eng = llm.engine
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=33)
    first = llm.generate(PROMPTS[:3], sampled)
    again = llm.generate(PROMPTS[:3], sampled)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 33 or o.finish_reason == "stop" for o in first)
    stats = eng.speculator.stats()
    assert stats["draft_tokens"] == sum(o.metrics.draft_tokens for o in first + again) > 0
    assert stats["accepted_tokens"] == sum(o.metrics.accepted_tokens for o in first + again)
    assert 1.0 <= stats["mean_accepted_length"] <= 1 + NGRAM["num_speculative_tokens"]
    metrics = ServerMetrics()
    metrics.watch_speculation(eng.speculator)
    text = generate_latest(metrics.registry).decode()
    assert f"jserve_spec_decode_num_draft_tokens_total {stats['draft_tokens']:.1f}" in text
    assert f"jserve_spec_decode_num_drafts_total {stats['drafts']:.1f}" in text


@pytest.mark.slow
def test_nothing_compiles_after_warmup_with_drafts():
    """Warm-up compiles every widened decode bucket, both samplers (the plain decoding
    rows' and the widest step's) and the two swap programs; a workload with drafts then
    compiles nothing."""
    llm = small_llm(MODEL, warmup=True, speculative_config=NGRAM)
    eng = llm.engine
    warm = eng.compile_count
    assert warm == len(eng.buckets.all_shapes()) + 2 + 2
    assert eng.buckets.decode_rows[-1] == 4 * (1 + NGRAM["num_speculative_tokens"])
    llm.generate(PROMPTS, [GREEDY, SamplingParams(temperature=0.9, seed=3, max_tokens=20)] * 2
                 + [GREEDY])
    assert eng.scheduler.num_draft_tokens > 0 and eng.compile_count == warm

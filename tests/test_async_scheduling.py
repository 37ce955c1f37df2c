"""Async scheduling (the host plans step N+1 while step N runs, tokens read one step late)
against the synchronous engine: the same tokens, text, finish reasons and logprobs for
greedy, seeded, penalised, stop-string, stop-id, min_tokens and max_tokens requests, with
and without preemption (recompute and swap); aborts mid-stream; no token streamed after a
request finishes; blocks conserved after every step. The mesh matrix runs both modes too
(tests/test_mesh_matrix.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jserve import SamplingParams
from jserve.scheduler import PLACEHOLDER
from llm_helpers import check_blocks, small_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The quick brown fox", "jumps over", "the lazy dog, and then a bit more text " * 2,
           "zz", "a much longer prompt " * 5, "seeded one"]
# 10 usable blocks of 16 tokens (default model: 4 layers x 2 KV heads x 64 x f32, K and V).
TINY_POOL = dict(kv_cache_bytes=11 * 2 * 4 * 2 * 16 * 64 * 4, max_model_len=160)


@pytest.fixture(scope="module")
def workload():
    """One request of each kind; stop string and stop id are taken from a greedy run so
    they are hit mid-generation."""
    ref = small_llm().generate(PROMPTS[1:3], GREEDY)
    return [
        dataclasses.replace(GREEDY, logprobs=3),
        dataclasses.replace(GREEDY, stop=[ref[0].text[5:8]]),
        dataclasses.replace(GREEDY, stop_token_ids=[ref[1].token_ids[3]], min_tokens=2),
        dataclasses.replace(GREEDY, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                       repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=13,
                       ignore_eos=True, logprobs=2),
    ]


def _drive(eng, prompts, params, abort_after: dict[int, int] | None = None):
    """Runs the requests to completion, checking blocks after every step; returns each
    request's outputs in the order they came, and aborts request i once it has streamed
    ``abort_after[i]`` tokens."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    index = {rid: i for i, rid in enumerate(ids)}
    seen: dict[int, list] = {i: [] for i in range(len(ids))}
    while eng.has_unfinished():
        for o in eng.step():
            seen[index[o.request_id]].append(o)
            limit = (abort_after or {}).get(index[o.request_id])
            if not o.finished and limit is not None and o.num_tokens >= limit:
                seen[index[o.request_id]].append(eng.abort(o.request_id))
        check_blocks(eng)
    assert eng.allocator.num_allocated == 0
    return seen


def _final(seen):
    return {i: outs[-1] for i, outs in seen.items()}


def _assert_same(got, want):
    for i in want:
        g, w = got[i], want[i]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), i
        assert (g.logprobs is None) == (w.logprobs is None), i
        for a, b in zip(g.logprobs or [], w.logprobs or []):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose([a.logprob] + [v for _, v in a.top],
                                       [b.logprob] + [v for _, v in b.top], atol=1e-4)


@pytest.mark.parametrize("pool", ["roomy", "recompute", "swap"])
def test_async_gives_the_synchronous_results(workload, pool):
    settings = {"roomy": {}, "recompute": dict(preemption="recompute", **TINY_POOL),
                "swap": dict(preemption="swap", **TINY_POOL)}[pool]
    runs = {}
    for mode in (False, True):
        eng = small_llm(async_scheduling=mode, **settings).engine
        runs[mode] = _drive(eng, PROMPTS, workload)
        if pool != "roomy":
            assert eng.scheduler.num_preemptions > 0, mode
    want = _final(runs[False])
    assert {w.finish_reason for w in want.values()} == {"stop", "length"}
    _assert_same(_final(runs[True]), want)


def test_no_token_is_streamed_after_a_request_finishes(workload):
    seen = _drive(small_llm().engine, PROMPTS, workload)
    for i, outs in seen.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], i
        counts = [o.num_tokens for o in outs]
        assert counts == sorted(counts) and counts[-1] == len(outs[-1].token_ids), i
        assert PLACEHOLDER not in outs[-1].token_ids


def test_abort_mid_stream_keeps_exactly_the_streamed_tokens(workload):
    abort_after = {0: 3, 4: 5, 5: 1}
    runs = {mode: _drive(small_llm(async_scheduling=mode).engine, PROMPTS, workload,
                         abort_after) for mode in (False, True)}
    full = _final(_drive(small_llm().engine, PROMPTS, workload))
    got, want = _final(runs[True]), _final(runs[False])
    _assert_same(got, want)
    for i, n in abort_after.items():
        assert got[i].finish_reason == "abort" and got[i].token_ids == full[i].token_ids[:n]


@pytest.mark.parametrize("burst", [1, 4])
def test_the_host_plans_the_next_step_before_reading_this_one(burst):
    """While decoding, each step (one token, or a decode burst's) leaves the newest token
    on the device: the request's last id is a placeholder the next step feeds from there
    (synchronous: never)."""
    for mode in (False, True):
        eng = small_llm(async_scheduling=mode, decode_burst=burst).engine
        rid = eng.add_request(PROMPTS[0], GREEDY)
        req = eng.requests[rid]
        fed = []
        eng.step_log = []
        while eng.has_unfinished():
            eng.step()
            fed.append(req.all_token_ids[-1] == PLACEHOLDER)
        # Async: after each step but the last (the prompt is one chunk); the 12th token
        # ends the request by length, so it is held until read by one more step.
        n = GREEDY.max_tokens
        steps = [plan.burst for plan, _ in eng.step_log]
        assert sum(steps) == n and (max(steps) == burst > 1 or steps == [1] * n)
        assert fed == ([True] * (len(steps) - 1) + [False, False] if mode
                       else [False] * len(steps)), mode

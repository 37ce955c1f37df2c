"""The length rule (``jserve.scheduler.request.length_room``) is one function: plain decoding,
decode bursts and n-gram speculation stop every request at the same token, whatever
``max_tokens``, ``min_tokens``, a stop id and the context leave it."""
from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jserve import SamplingParams
from jserve.lengths import length_room
from jserve.scheduler.request import Request
from llm_helpers import check_blocks, small_llm

MODEL = "tiny-tasks"  # counts down: text that repeats, so n-gram drafts are accepted
MAX_MODEL_LEN = 48    # small, so requests end by the context as well as by max_tokens
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
MODES = {"plain": dict(decode_burst=1), "bursts": dict(decode_burst=4),
         "ngram": dict(decode_burst=1, speculative_config=NGRAM)}


@pytest.fixture(scope="module")
def engines():
    return {mode: small_llm(MODEL, max_model_len=MAX_MODEL_LEN, **kw).engine
            for mode, kw in MODES.items()}


def _run(eng, prompts, params, seen: collections.Counter, mode: str):
    """(token ids, finish reason) of each request, pages checked after every step."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    eng.step_log = []
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (o.token_ids, o.finish_reason)
                seen[f"{mode} accepted"] += o.metrics.accepted_tokens
        check_blocks(eng)
        # No request holds a token past its limit, drafts and tokens on the device counted.
        assert all(r.room(MAX_MODEL_LEN) >= 0 and len(r.all_token_ids) + len(r.draft_ids)
                   <= len(r.prompt_token_ids) + r.max_tokens for r in eng.scheduler.running)
    assert eng.allocator.num_free == eng.allocator.total
    seen[f"{mode} bursts"] += sum(p.burst > 1 for p, _ in eng.step_log)
    return [done[i] for i in ids]


@st.composite
def _case(draw, tokenizer):
    """A prompt and its limits: max_tokens up to what the context leaves (often exactly
    that), a min_tokens ban, EOS honoured or not."""
    prompt = f"count down from {draw(st.integers(3, 40))}"
    room = MAX_MODEL_LEN - len(tokenizer.encode(prompt))
    max_tokens = draw(st.one_of(st.just(room), st.integers(1, room)))
    return prompt, dict(temperature=0.0, max_tokens=max_tokens,
                        min_tokens=draw(st.integers(0, max_tokens)),
                        ignore_eos=draw(st.booleans()))


def test_plain_bursts_and_speculation_stop_at_the_same_token(engines):
    tok = engines["plain"].tokenizer
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases=st.lists(_case(tok), min_size=1, max_size=4), stop_at=st.data())
    def check(cases, stop_at):
        prompts = [p for p, _ in cases]
        params = [SamplingParams(**kw) for _, kw in cases]
        plain = _run(engines["plain"], prompts, params, seen, "plain")
        # A stop id the plain run makes: hit mid-output (or banned, under min_tokens).
        out = plain[0][0]
        stop = out[stop_at.draw(st.integers(0, len(out) - 1))]
        params = [SamplingParams(**kw, stop_token_ids=[stop]) for _, kw in cases]
        want = _run(engines["plain"], prompts, params, seen, "plain")
        for (prompt, kw), (ids, reason) in zip(cases, want):
            n = len(tok.encode(prompt))
            limit = length_room(kw["max_tokens"], n, 0, MAX_MODEL_LEN)
            assert len(ids) <= limit
            assert (len(ids) == limit) if reason == "length" else reason == "stop"
            assert reason == "length" or len(ids) >= kw["min_tokens"]
        for mode in ("bursts", "ngram"):
            assert _run(engines[mode], prompts, params, seen, mode) == want, mode

    check()
    # The modes were what they say: bursts ran and drafts were accepted.
    assert seen["bursts bursts"] > 0 and seen["ngram accepted"] > 0, seen
    assert seen["plain bursts"] == 0 and seen["plain accepted"] == 0, seen


def test_a_requests_room_counts_its_tokens_on_the_device():
    req = Request("r", [1, 2, 3], max_tokens=5, arrival_time=0.0)
    assert req.room(10) == 5 and req.room(6) == 3    # max_tokens, then the context
    req.all_token_ids += [-1, -1]                          # two placeholders in flight
    assert req.room(10) == 3 and req.room(10, ahead=3) == 0 and req.room(7) == 2

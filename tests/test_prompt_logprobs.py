"""Prompt logprobs (``SamplingParams.prompt_logprobs``, jserve/engine/requests/prompt_logprobs.py):
every prompt token's logprob, rank and top alternatives equal a reference taken from the
full logits of one forward over the whole prompt, whether the prompt runs in one chunk or
several (and in blocks of rows), after a cached prefix, beside ordinary requests (whose
tokens do not change), through recompute and swap preemption (no entry twice), with
speculative decoding and decode bursts; ``max_tokens=0`` scores the prompt and generates
nothing; KV pages conserved after every step."""
from __future__ import annotations

import dataclasses
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devices import run_on_devices
from jserve import SamplingParams
from jserve.cache.pool import allocate_kv_cache
from jserve.engine.requests import prompt_logprobs
from jserve.engine.requests.output import TokenLogprob
from jserve.kernels import AttentionMetadata
from jserve.model.decoder import StepInput, forward, to_runtime_layout
from jserve.model.weights import load_model
from llm_helpers import check_blocks, small_llm

K = 5
SCORED = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
PLAIN = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
rng = np.random.default_rng(5)
DOC = rng.integers(0, 256, 70).tolist()  # 4 full pages of 16 and 6 tokens
PROMPTS = [DOC + rng.integers(0, 256, 30).tolist(), rng.integers(0, 256, 9).tolist(),
           DOC[:40] + [7, 8, 9], [17]]
TINY_POOL = dict(kv_cache_bytes=9 * 2 * 4 * 2 * 16 * 64 * 4, max_model_len=160)  # 8 pages


@functools.cache
def _model():
    cfg, params, _ = load_model("default")
    return cfg, to_runtime_layout(params)


@functools.partial(jax.jit, static_argnames=("cfg", "pages"))
def _all_logits(params, batch, *, cfg, pages):
    return forward(params, allocate_kv_cache(cfg, pages + 1, 16), batch, cfg=cfg)[0]


def reference(ids: list[int]) -> list[tuple[int, float, int, list[int], np.ndarray]]:
    """Per position i >= 1: (token, logprob, rank, top-K ids, top-K logprobs) from the
    log-softmax of one prefill of the whole prompt with logits at every position."""
    cfg, params = _model()
    t = 128 * -(-len(ids) // 128)
    pos = np.arange(t, dtype=np.int32)
    table = np.arange(1, t // 16 + 1, dtype=np.int32)[None]
    attn = AttentionMetadata(positions=jnp.asarray(pos), token_seq=jnp.zeros(t, jnp.int32),
                             kv_lens=jnp.asarray([t], jnp.int32), page_table=jnp.asarray(table),
                             num_prefills=jnp.asarray(1, jnp.int32), num_decodes=0)
    batch = StepInput(tokens=jnp.asarray(ids + [0] * (t - len(ids)), jnp.int32),
                      slots=jnp.asarray(table[0, pos // 16] * 16 + pos % 16),
                      logits_rows=jnp.asarray(pos), attn=attn)
    logits = np.asarray(_all_logits(params, batch, cfg=cfg, pages=t // 16), np.float64)
    ls = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    out = []
    for i in range(1, len(ids)):
        row = ls[i - 1]
        top = np.argsort(-row, kind="stable")[:K]
        out.append((ids[i], row[ids[i]], 1 + int((row > row[ids[i]]).sum()), top.tolist(),
                    row[top]))
    return out


def assert_scored(entries, ids: list[int], k: int = K) -> None:
    """``entries`` (a RequestOutput's prompt_logprobs) equal the reference of ``ids``."""
    assert entries[0] is None and len(entries) == len(ids)
    for e, (tok, lp, rank, top_ids, top_lp) in zip(entries[1:], reference(ids), strict=True):
        assert e.token_id == tok and e.rank == rank
        assert [t for t, _ in e.top] == top_ids[:k]
        np.testing.assert_allclose([e.logprob, *(v for _, v in e.top)],
                                   [lp, *top_lp[:k]], atol=2e-4)


def _run(llm, prompts, params) -> list:
    """Final outputs in prompt order; blocks checked after every step."""
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    eng.step_log = []
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        check_blocks(eng)
    assert eng.allocator.num_allocated == 0
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def plain_tokens():
    """Each prompt's greedy tokens without prompt logprobs."""
    return [o.token_ids for o in small_llm().generate(PROMPTS, PLAIN)]


@pytest.mark.slow
def test_one_chunk_matches_the_full_forward(plain_tokens):
    outs = _run(small_llm(max_num_batched_tokens=128), PROMPTS, [SCORED] * len(PROMPTS))
    for o, p, want in zip(outs, PROMPTS, plain_tokens):
        assert_scored(o.prompt_logprobs, p)
        assert o.token_ids == want and o.logprobs is None


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunks_and_row_blocks_match_the_full_forward(monkeypatch, plain_tokens,
                                                      async_scheduling):
    """32-token chunks (a chunk's last token scores the next chunk's first), the LM head in
    blocks of 16 rows (blocks without targets skipped), one request with max_tokens=0."""
    monkeypatch.setattr(prompt_logprobs, "BLOCK_LOGITS", 320 * 16)
    llm = small_llm(async_scheduling=async_scheduling)
    params = [SCORED, dataclasses.replace(SCORED, max_tokens=0), SCORED,
              dataclasses.replace(SCORED, prompt_logprobs=0)]
    outs = _run(llm, PROMPTS, params)
    for o, p, sp, want in zip(outs, PROMPTS, params, plain_tokens):
        assert_scored(o.prompt_logprobs, p, sp.prompt_logprobs)
        assert o.token_ids == (want if sp.max_tokens else [])
        assert o.finish_reason == "length"


@pytest.mark.slow
def test_a_cached_prefix_is_still_scored_and_its_pages_are_offered():
    """The request takes no cached page (every position scored); a later plain request
    finds the pages it wrote."""
    llm = small_llm()
    eng = llm.engine
    best = dataclasses.replace(SCORED, prompt_logprobs=1)  # the best alternative: a max
    first = _run(llm, [DOC + [1, 2]], [PLAIN])[0]
    scored = _run(llm, [DOC + [3, 4, 5]], [best])[0]
    assert scored.metrics.cached_tokens == 0
    assert_scored(scored.prompt_logprobs, DOC + [3, 4, 5], 1)
    fresh = small_llm()  # no cache from `first`: only the scored request's pages
    _run(fresh, [DOC + [3, 4, 5]], [best])
    later = _run(fresh, [DOC + [6]], [PLAIN])[0]
    assert later.metrics.cached_tokens == 64 and first.token_ids
    assert eng.scheduler.prefix_hit_tokens == 0  # the scored request looked nothing up


@pytest.mark.slow
def test_beside_ordinary_requests(plain_tokens):
    """Scored and plain requests in the same steps: the plain ones' tokens are those they
    get alone; pages conserved after every step (``_run``)."""
    outs = _run(small_llm(), PROMPTS, [SCORED if i % 2 else PLAIN for i in range(len(PROMPTS))])
    for i, (out, p, want) in enumerate(zip(outs, PROMPTS, plain_tokens)):
        assert out.token_ids == want
        if i % 2:
            assert_scored(out.prompt_logprobs, p)
        else:
            assert out.prompt_logprobs is None


@pytest.mark.slow
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_adds_no_entry_twice(preemption):
    params = dataclasses.replace(SCORED, max_tokens=30)
    prompts = [DOC + rng.integers(0, 256, n).tolist() for n in (5, 15, 25)]
    llm = small_llm(preemption=preemption, **TINY_POOL)
    outs = _run(llm, prompts, [params] * 3)
    assert llm.engine.scheduler.num_preemptions > 0
    for o, p in zip(outs, prompts):
        assert_scored(o.prompt_logprobs, p)


@pytest.mark.slow
@pytest.mark.parametrize("engine", [dict(decode_burst=4),
                                    dict(speculative_config={
                                        "method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})])
def test_with_decode_bursts_and_speculative_decoding(engine):
    """The scored request decodes as without prompt logprobs (bursts, drafts)."""
    prompts = [DOC[:20] * 3, DOC[:9] * 4]
    params = [dataclasses.replace(SCORED, max_tokens=24), PLAIN]
    want = _run(small_llm(), prompts, [dataclasses.replace(PLAIN, max_tokens=24), PLAIN])
    llm = small_llm(**engine)
    got = _run(llm, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_scored(got[0].prompt_logprobs, prompts[0])
    eng = llm.engine
    if "decode_burst" in engine:
        assert sum(p.burst > 1 for p, _ in eng.step_log) > 0
    else:
        assert eng.scheduler.num_draft_tokens > 0


@pytest.mark.slow
def test_tensor_parallel_matches_and_the_pipeline_refuses():
    """tp=2: the LM head over the replicated residual stream gives the same entries; spp=2
    has no prompt logprobs and refuses them at intake, naming them."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, "tests")
        import test_prompt_logprobs as t
        from llm_helpers import small_llm
        outs = t._run(small_llm(mesh="tp=2"), t.PROMPTS, [t.SCORED] * len(t.PROMPTS))
        try:
            small_llm(mesh="spp=2").engine.prepare([1, 2], t.SCORED)
            refusal = None
        except ValueError as e:
            refusal = str(e)
        print(json.dumps({"refusal": refusal, "outs": [
            [None] + [[e.token_id, e.logprob, e.top, e.rank] for e in o.prompt_logprobs[1:]]
            for o in outs]}))
    """)
    res = run_on_devices(script, devices=2).result
    assert res["refusal"] == ("prompt_logprobs is not supported with stream pipeline "
                              "parallelism (spp > 1)")
    for entries, p in zip(res["outs"], PROMPTS, strict=True):
        assert_scored([None] + [TokenLogprob(t, lp, tuple(map(tuple, top)), rank)
                                for t, lp, top, rank in entries[1:]], p)


def test_refused_values_name_the_field():
    with pytest.raises(ValueError, match="^max_tokens .*0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    for bad in (21, -1, True, 1.5):
        with pytest.raises(ValueError, match="^prompt_logprobs must be"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="^max_tokens must be"):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_targets_cross_chunk_boundaries():
    prompt = [5, 6, 7, 8, 9]
    assert prompt_logprobs.targets(prompt, 0, 2).tolist() == [6, 7]  # token 1 scores 7
    assert prompt_logprobs.targets(prompt, 2, 3).tolist() == [8, 9, -1]  # last: sampled
    assert prompt_logprobs.targets(prompt, 4, 1).tolist() == [-1]
    assert prompt_logprobs.targets(prompt, 5, 2).tolist() == [-1, -1]  # recomputed outputs
    assert prompt_logprobs.block_rows(2048, 128256) == 128
    assert prompt_logprobs.block_rows(40, 320) == 40

"""Gemma 3's two KV layer groups (``jserve.cache.hybrid``): the windowed layers give back the
pages their window has passed while a request runs, the global layers keep every page. On
the tiny Gemma 3 (layers local, local, global, local; window 20) with pages of 8 tokens, a
request of 8 windows: greedy tokens equal transformers' generate (decoding in bursts too),
and tokens and logprobs
equal the same engine with nothing freed (the local group's window switched off), while
every free local page is overwritten with garbage after every step (a freed page read as live
would change the logprobs); at the end of its prefill the local group holds exactly the pages
the last chunk's first query still reads and the global group all of them; both pools are
conserved after every step and empty at the end. With prefix caching a follow-up turn finds
its whole prefix (every global page, the local pages of its last window), and three requests
under pools too small for them together are preempted (recompute) and give the tokens they
give in a roomy pool. The pool sizing and the memory plan count a request's pages by group."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from hf_models import tiny_llama_dir, tiny_llama_model
from jserve import SamplingParams
from jserve.cache.allocator import PageAllocator, held_pages
from jserve.cache.hybrid import HybridAllocator, request_layer_pages, split_pages
from jserve.cache.pool import HybridKV
from jserve.engine.build.kv_groups import kv_groups
from jserve.engine.build.memory_plan import plan
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.model.weights import load_model
from llm_helpers import assert_same_output

PS, W, CHUNK = 8, 20, 32
L = 8 * W  # 160 prompt tokens: 20 pages, 22 with the 16 generated
POOL = 100  # pages of each group: room for every case with nothing freed
BASE = dict(max_num_seqs=4, max_num_batched_tokens=CHUNK, max_prefill_seqs=2,
            max_model_len=256, page_size=PS, warmup=False, num_kv_pages=POOL,
            num_local_kv_pages=POOL, decode_burst=4)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
rng = np.random.default_rng(7)
LONG = rng.integers(3, 256, L).tolist()
THREE = [rng.integers(3, 256, n).tolist() for n in (120, 150, 170)]
POISON = 1e3


@pytest.fixture(scope="module")
def engine():
    cfg, params, tok = load_model(str(tiny_llama_dir("gemma3")))
    assert cfg.layer_windows == (W, W, 0, W)
    eng = LLMEngine(cfg, params, tok, EngineConfig(**BASE, preemption="auto"))
    assert isinstance(eng.allocator, HybridAllocator) and eng.scheduler.swap_policy is None
    assert isinstance(eng.runner.kv_cache, HybridKV)
    return eng


def _switch(eng: LLMEngine, *, free: bool, prefix: bool = False) -> LLMEngine:
    eng.allocator.local.window = W if free else None  # None: the local halves stay held
    eng.allocator.prefix_caching = eng.allocator.local.prefix_caching = prefix
    return eng


@jax.jit
def _poison(kv, ids):
    return kv._replace(loc=jax.tree.map(lambda x: x.at[:, :, ids].set(POISON), kv.loc))


def _poison_free_local_pages(eng: LLMEngine) -> None:
    free = eng.allocator.local.free_pages()
    if free:
        ids = np.full(eng.allocator.local.pool_pages, free[0], np.int32)
        ids[:len(free)] = free
        eng.runner.kv_cache = _poison(eng.runner.kv_cache, ids)


def _check(eng: LLMEngine, hog: tuple[list[int], list[int]]) -> None:
    """Both pools conserved, held exactly by the running requests (and ``hog``: pages
    taken out of the global and the local pool); waiting requests hold none."""
    alloc, sched = eng.allocator, eng.scheduler
    alloc.check()
    split = [alloc.split(blocks) for blocks in sched.page_holders()]
    PageAllocator.check_holders(alloc, [g for g, _ in split] + [hog[0]])
    alloc.local.check_holders([[b for b in loc if b] for _, loc in split] + [hog[1]])
    assert all(not r.page_ids for r in sched.waiting)


def _run(eng: LLMEngine, prompts, hog=(0, 0), on_step=None, params=PARAMS) -> list:
    """Runs ``prompts`` to the end with ``hog`` (global, local) pages taken out of the
    pools, checking both after every step and poisoning the free local pages; returns
    (token ids, logprobs) in prompt order."""
    alloc = eng.allocator
    taken = (PageAllocator.extend(alloc, (), hog[0]) if hog[0] else [],
             alloc.local.allocate(hog[1]) if hog[1] else [])
    ids = [eng.add_request(p, params) for p in prompts]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = (o.token_ids, [(lp.token_id, lp.logprob, lp.top)
                                                    for lp in o.logprobs or ()])
        _check(eng, taken)
        if on_step is not None:
            on_step(eng)
        _poison_free_local_pages(eng)
    PageAllocator.free(alloc, taken[0])
    alloc.local.free(taken[1])
    assert alloc.num_allocated == alloc.local.num_allocated == 0
    return [outs[i] for i in ids]


def _held(eng: LLMEngine, seen: list) -> None:
    """(computed, global pages held, local pages held) of the running requests."""
    alloc = eng.allocator
    for r in eng.scheduler.running:
        glob, loc = alloc.split(r.page_ids)
        seen.append((r.num_computed, sum(map(bool, glob)), sum(map(bool, loc))))


@pytest.mark.slow
def test_a_long_request_frees_local_pages_with_the_tokens_of_generate(engine):
    with torch.no_grad():
        want = tiny_llama_model("gemma3").generate(
            torch.tensor([LONG]), max_new_tokens=16, do_sample=False, eos_token_id=None,
            pad_token_id=0)[0, L:].tolist()
    kept, freed = [], []
    ref = _run(_switch(engine, free=False), [LONG], on_step=lambda e: _held(e, kept))[0]
    got = _run(_switch(engine, free=True), [LONG], on_step=lambda e: _held(e, freed))[0]
    assert ref[0] == want
    assert_same_output(got, ref)
    # Without logprobs the decodes run in bursts of 4, the last one 3 (the local slots
    # advance on the device too): the same tokens.
    engine.step_log = []
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert _run(engine, [LONG], params=plain)[0][0] == want
    assert [p.burst for p, _ in engine.step_log if not p.prefills] == [4, 4, 4, 3]
    engine.step_log = None
    # End of prefill (160 computed, the last chunk from 128): nothing freed holds 20 pages
    # in each group; freeing, the global group still 20, the local one all but the pages
    # dead for position 128 (keys <= 108: pages 0-12): 7, under held_pages' bound of 8.
    assert (L, 20, 20) in kept and (L, 20, 7) in freed
    assert held_pages(L, PS, W, CHUNK) == 8
    # Decoding: the local group holds the pages the next query reads, never more than 4
    # (nothing freed: 21-22).
    assert max(n for c, _, n in freed if c > L) == 4
    assert all(g == -(-c // PS) for c, g, _ in freed)


@pytest.mark.slow
def test_prefix_hits_and_preemption_keep_the_tokens(engine):
    # A follow-up turn: the first request's prompt and output, then 12 new tokens.
    first = _run(_switch(engine, free=True, prefix=True), [LONG])[0]
    turn = LONG + first[0] + rng.integers(3, 256, 12).tolist()
    hits = engine.scheduler.prefix_hit_tokens
    got = _run(engine, [turn])[0]
    # Of the first's 175 computed tokens (the last output's KV is never written), 21 full
    # pages were cached: every global one, and the local ones a query at 168 reads (keys >
    # 148: pages 18-20; 18 dropped by the first's last query, idle in the cache since).
    assert engine.scheduler.prefix_hit_tokens - hits == 21 * PS
    alone = _run(_switch(engine, free=False), [turn])[0]
    assert_same_output(got, alone)
    # Three requests, roomy, then with 88 of the 99 local pages taken out (11 left, under
    # the three's 8 + 8 + 8 in prefill; every page of one request alone would be 24).
    roomy = _run(_switch(engine, free=True), THREE)
    preemptions = engine.scheduler.num_preemptions
    small = _run(engine, THREE, hog=(0, POOL - 12))
    assert engine.scheduler.num_preemptions > preemptions
    for a, b in zip(small, roomy):
        assert_same_output(a, b)
    # And with the global pool short instead (30 of 99 left: one request needs 22-24).
    preemptions = engine.scheduler.num_preemptions
    small = _run(engine, THREE, hog=(POOL - 31, 0))
    assert engine.scheduler.num_preemptions > preemptions
    for a, b in zip(small, roomy):
        assert_same_output(a, b)


# -- sizing (no engine) --------------------------------------------------------------------
def test_pools_split_a_budget_by_what_a_request_holds():
    cfg, _, _ = load_model(str(tiny_llama_dir("gemma3")))
    # 4 seqs x 256 tokens: 32 global pages each, held_pages(256, 8, 20, 32) = 8 local.
    assert held_pages(256, PS, W, CHUNK) == 8
    assert split_pages(10_000, 1, 3, 128, 32) == (129, 33)  # room for all: capped
    assert split_pages(4 + (128 + 3 * 32) // 2, 1, 3, 128, 32) == (65, 17)  # half of each
    per_layer = 2 * 2 * PS * 20 * 4  # a page of one layer: K and V, 2 KV heads x 20, f32
    config = EngineConfig(**{**BASE, "num_kv_pages": None, "num_local_kv_pages": None},
                          kv_cache_bytes=per_layer * (4 + 112))
    groups = kv_groups(cfg, config, mesh_size=1, layer_mode="unrolled", max_model_len=256,
                       max_chunk=CHUNK)
    assert (groups.global_pages, groups.local_pages, groups.window) == (65, 17, W)
    # The explicit global pool scales the local one by the same ratio (99 x 32 / 128 + 1).
    groups = kv_groups(cfg, EngineConfig(**{**BASE, "num_local_kv_pages": None}),
                       mesh_size=1, layer_mode="unrolled", max_model_len=256, max_chunk=CHUNK)
    assert (groups.global_pages, groups.local_pages) == (POOL, 26)
    # Configurations the groups are not built for keep every page (one group).
    assert kv_groups(cfg, EngineConfig(**BASE), mesh_size=1, layer_mode="loop",
                     max_model_len=256, max_chunk=CHUNK) is None
    assert kv_groups(cfg, EngineConfig(**BASE, preemption="swap"), mesh_size=1,
                     layer_mode="unrolled", max_model_len=256, max_chunk=CHUNK) is None
    # The memory plan counts a request by group: 1 global layer x 32 + 3 local layers x 8
    # layer pages for a 256-token request (every page kept: 4 x 32).
    p = plan(cfg, EngineConfig(**BASE), compile=False)
    assert (p.num_kv_pages, p.local_kv_pages, p.local_window) == (POOL, POOL, W)
    assert p.request_kv_bytes(256) == (32 + 3 * 8) * per_layer
    assert request_layer_pages(cfg, 256, PS, CHUNK, hybrid=True) == 32 + 3 * 8
    assert request_layer_pages(cfg, 256, PS, CHUNK, hybrid=False) == 4 * 32
    assert p.requests_at_once(256) == 3  # the global pool: 99 // 32

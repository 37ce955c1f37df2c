"""Sliding-window KV pages: a running request of a model whose every layer is windowed
(``ModelConfig.kv_window``) gives back the pages its window has passed, so a request of 8
windows holds about one window plus one chunk at the end of its prefill (counted exactly
against ``pages_for(computed) - dead_pages(last chunk start)``), with greedy tokens and
logprobs identical to the same model run with freeing off; pages conserved after every step
with prefix caching and a second request sharing the prompt's prefix (no hit ever finds a
freed page) and under recompute and swap preemption (a swap moves only the held pages and
brings back as many for the same positions); every free page is overwritten with garbage
after every step, so a freed page read as live would change the logprobs. The memory plan
and the engine's pool count a windowed request's pages as ``held_pages``."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from jserve import SamplingParams
from jserve.cache.allocator import PageAllocator, held_pages
from jserve.cache.prefix import extend_page_keys
from jserve.engine.build.memory_plan import plan
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.engine.requests.intake import RequestIntake
from jserve.model.families import read_config_file
from jserve.model.weights import load_model
from jserve.scheduler.plan import BatchPlan, ScheduledChunk, with_chunk
from jserve.scheduler.predictor import LinearPredictor, plan_features
from jserve.scheduler.request import Request, RequestStatus
from jserve.scheduler.sarathi import SarathiScheduler
from jserve.scheduler.swap import SwapPolicy
from llm_helpers import assert_same_output

PS, W, CHUNK = 16, 24, 32
L = 8 * W  # 192 tokens: 12 pages without freeing
BASE = dict(max_num_seqs=4, max_num_batched_tokens=CHUNK, max_prefill_seqs=2,
            max_model_len=256, page_size=PS, warmup=False)
POOL = 15  # pages (one is the sink): a request of L + 16 tokens needs 13 with nothing freed
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
rng = np.random.default_rng(5)
LONG = rng.integers(0, 256, L).tolist()
DOC = rng.integers(0, 256, 34).tolist()
CASES = {
    "long": [LONG],
    # The third arrives two steps after the first (once the first chunk's pages are
    # registered) and finds its two full pages, which the first's decodes still read until
    # their queries pass position 38.
    "shared_prefix": [DOC, rng.integers(0, 256, 20).tolist(),
                      DOC + rng.integers(0, 256, 150).tolist()],
    "recompute": [rng.integers(0, 256, n).tolist() for n in (120, 150, 170)] + [LONG],
}
CASES["swap"] = CASES["recompute"]
# Pages the preemption cases take out of the pool before they run, leaving 8 (fewer than
# one long request needs without freeing): an engine of its own would compile its own
# programs for that pool.
HOGGED = 6
POISON = 1e3  # what free pages hold after every step: finite, far from any real KV


@pytest.fixture(scope="module")
def engine():
    """One engine for every run (one set of compiled programs): the window, prefix caching
    and swapping are switched per run."""
    cfg, params, tok = load_model("default")
    cfg = dataclasses.replace(cfg, layer_windows=(W,) * cfg.num_hidden_layers)
    eng = LLMEngine(cfg, params, tok, EngineConfig(**BASE, num_kv_pages=POOL,
                                                   preemption="swap"))
    return eng, eng.scheduler.swap_policy


def _switch(engine, *, window: bool, prefix: bool = False, swap: bool = False) -> LLMEngine:
    eng, swap_policy = engine
    eng.allocator.window = W if window else None  # None: nothing is freed
    eng.allocator.prefix_caching = prefix
    eng.scheduler.swap_policy = swap_policy if swap else None
    return eng


@jax.jit
def _poison(kv, ids):
    return jax.tree.map(lambda x: x.at[:, :, ids].set(POISON), kv)


def _poison_free_pages(eng: LLMEngine) -> None:
    """Overwrites every free page (held by none, cached by none) in every layer."""
    free = eng.allocator.free_pages()
    if free:
        ids = np.full(eng.allocator.pool_pages, free[0], np.int32)
        ids[:len(free)] = free
        eng.runner.kv_cache = _poison(eng.runner.kv_cache, ids)


def _check(eng: LLMEngine, hog: list[int]) -> None:
    """Pages conserved and held exactly by the running requests (and ``hog``), waiting
    requests hold none, exactly the swapped ones have a host copy, and none holds more than
    ``pages_held`` of its length."""
    alloc, sched = eng.allocator, eng.scheduler
    alloc.check()
    alloc.check_holders(sched.page_holders() + [hog])
    assert all(not r.held_page_ids for r in sched.waiting)
    assert set(eng.host_kv.copies) == {r.request_id for r in sched.waiting if r.swapped}
    for r in sched.running:
        assert len(r.held_page_ids) <= alloc.pages_held(len(r.prompt_token_ids)
                                                        + PARAMS.max_tokens)


def _run(eng: LLMEngine, prompts, staggered: bool = False, hogged: int = 0,
         on_step=None) -> list:
    """Runs ``prompts`` to the end (one added a step when ``staggered``) with ``hogged``
    pages taken out of the pool, checking pages after every step and overwriting the free
    ones; returns (token ids, logprobs) in prompt order."""
    hog = eng.allocator.allocate(hogged) if hogged else []
    pending, ids, outs = list(prompts), [], {}
    while pending or eng.has_unfinished():
        for _ in range(1 if staggered else len(pending)):
            if pending:
                ids.append(eng.add_request(pending.pop(0), PARAMS))
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = (o.token_ids, [(lp.token_id, lp.logprob, lp.top)
                                                    for lp in o.logprobs])
        _check(eng, hog)
        if on_step is not None:
            on_step(eng)
        _poison_free_pages(eng)
    eng.allocator.free(hog)
    assert eng.allocator.num_allocated == 0
    return [outs[i] for i in ids]


@pytest.fixture(scope="module")
def reference(engine):
    """Every prompt alone, nothing freed (the window switched off in the allocator: the
    model still attends through its window), no prefix caching."""
    eng = _switch(engine, window=False)
    prompts = {tuple(p) for ps in CASES.values() for p in ps}
    return {p: _run(eng, [list(p)])[0] for p in prompts}


def _held_as_formula(eng: LLMEngine, seen: list) -> None:
    """The long request alone, prefilled in whole chunks: it holds the pages up to its
    computed tokens but those dead for its latest chunk's first query."""
    alloc = eng.allocator
    for r in eng.scheduler.running:
        nc = r.num_computed
        last_start = nc - CHUNK if nc <= L else nc - 1
        assert len(r.held_page_ids) == alloc.pages_for(nc) - alloc.dead_pages(last_start)
        seen.append((nc, len(r.held_page_ids)))


def _swapped_windowed(eng: LLMEngine, seen: list) -> None:
    seen += [r.request_id for r in eng.scheduler.waiting if r.swapped and r.num_dropped_pages]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_windowed_requests_free_pages_with_identical_tokens(engine, reference, case):
    eng = _switch(engine, window=True, prefix=case == "shared_prefix", swap=case == "swap")
    sched = eng.scheduler
    preemptions, swaps, hits = sched.num_preemptions, sched.num_swaps, sched.prefix_hit_tokens
    seen: list = []
    watch = {"long": _held_as_formula, "swap": _swapped_windowed}.get(case)
    got = _run(eng, CASES[case], staggered=case == "shared_prefix",
               hogged=HOGGED if case in ("recompute", "swap") else 0,
               on_step=watch and (lambda e: watch(e, seen)))
    for p, out in zip(CASES[case], got):
        assert_same_output(out, reference[tuple(p)])
    if case == "long":
        # At the end of its prefill: 12 pages of KV written, 4 held (those dead for the last
        # chunk's first query, at 160, are positions <= 136: pages 0-7).
        assert (L, 12 - 8) in seen and held_pages(L, PS, W, CHUNK) == 5
    if case == "shared_prefix":
        assert sched.prefix_hit_tokens - hits == 32  # the third took the first's 2 pages
        # The third again, alone: it finds nothing, as every page of the prefix went back
        # free once the window had passed it (a passed prefix is not kept in the cache).
        assert_same_output(_run(eng, CASES[case][2:])[0], reference[tuple(CASES[case][2])])
        assert sched.prefix_hit_tokens - hits == 32
    if case in ("recompute", "swap"):
        assert sched.num_preemptions > preemptions
    assert (sched.num_swaps > swaps) == (case == "swap")
    if case == "swap":
        assert seen  # a request swapped with pages its window had dropped


# -- the scheduler alone (no JAX) ----------------------------------------------------------
def test_held_pages_is_the_most_a_sequence_holds():
    """Over every chunk start and size: pages up to the chunk's end less the dead ones never
    exceed ``held_pages``, and some chunk reaches it."""
    alloc = PageAllocator(64, PS, window=W, max_chunk=CHUNK)
    most = max(alloc.pages_for(q + n) - alloc.dead_pages(q)
               for q in range(0, 400) for n in range(1, CHUNK + 1))
    assert most == alloc.pages_held(10_000) == -(-(W + CHUNK + PS - 2) // PS) == 5
    assert alloc.pages_held(40) == 3 and PageAllocator(64, PS).pages_held(10_000) == 625
    assert [alloc.dead_pages(q) for q in (0, 23, 38, 39, 40, 54, 55)] == [0, 0, 0, 1, 1, 1, 2]


def test_intake_takes_a_windowed_request_longer_than_the_pool():
    """8 usable pages: a request of 192 + 16 tokens needs 13 without freeing (refused) and
    at most 5 with the window."""
    params = SamplingParams(max_tokens=16)
    windowed = RequestIntake(None, 256, 512, PageAllocator(9, PS, window=W, max_chunk=CHUNK))
    assert windowed.prepare(LONG, params).prompt_ids == LONG
    full = RequestIntake(None, 256, 512, PageAllocator(9, PS))
    with pytest.raises(ValueError, match="needs 13 KV pages; the pool has 8"):
        full.prepare(LONG, params)


def test_predictor_counts_at_most_a_window_of_context(tmp_path):
    """A decode at 1000 reads 24 keys, one at 10 reads 11; a chunk of 32 at 100 reads 24
    per query, one of 8 at 8 reads 16; the chunk timer prices a chunk as ``predict``, and a
    saved predictor keeps its window."""
    plan = BatchPlan((ScheduledChunk("a", 1000, 1, True), ScheduledChunk("b", 10, 1, True)),
                     (ScheduledChunk("c", 100, 32, False),))
    assert plan_features(plan, W).tolist() == [1, 34, 2, 24 + 11, 32 * 24, 1]
    assert plan_features(plan).tolist() == [1, 34, 2, 1001 + 11, 32 * 132, 1]
    pred = LinearPredictor((1e-3, 1e-5, 1e-4, 1e-6, 1e-7, 1e-4), window=W)
    longer = with_chunk(plan, "d", 8, 8, True)
    assert pred.chunk_timer(plan)("d", 8, 8, True) == pred.predict(longer)
    assert plan_features(longer, W)[4] == 32 * 24 + 8 * 16
    pred.save(tmp_path / "p.json")
    assert LinearPredictor.load(tmp_path / "p.json") == pred


def _keys_match(alloc: PageAllocator, req: Request) -> None:
    """Every cached page ``req`` holds is keyed by ``req``'s own tokens there."""
    keys = extend_page_keys([], req.all_token_ids, PS, len(req.all_token_ids) // PS)
    for j, b in enumerate(req.page_ids):
        if j >= req.num_dropped_pages and b in alloc._key_of and j < len(keys):
            assert alloc._key_of[b] == keys[j]


def test_scheduler_frees_passed_pages_with_sharing_and_swaps():
    """Constructed: a long request, two sharing its prefix (one arriving mid-prefill, one
    after), and swap preemption in a pool too small for all: after every step pages are
    conserved and held exactly by their holders, a held cached page is keyed by its holder's
    tokens, no free page is cached, and each swap brings back as many pages as it moved out,
    for the same positions."""
    alloc = PageAllocator(12, PS, window=W, max_chunk=CHUNK, prefix_caching=True)
    sched = SarathiScheduler(alloc, max_num_seqs=4, max_num_batched_tokens=CHUNK,
                             max_prefill_seqs=2)
    sched.swap_policy = SwapPolicy("swap", capacity_bytes=10 ** 9, page_bytes=1,
                                   round_trip_seconds=float, recompute_seconds=float)
    doc = list(range(1000, 1000 + L))
    # The second finds the first's two pages while its decodes still read them.
    arrivals = {0: [doc[:34]], 1: [doc[:34] + list(range(2000, 2150))], 2: [doc],
                9: [list(range(150)), doc + [4]]}
    moved: dict[str, tuple[int, int, int]] = {}
    step = windowed_swaps = 0
    while step in arrivals or sched.has_unfinished() or step < max(arrivals):
        for i, prompt in enumerate(arrivals.get(step, [])):
            sched.add(Request(f"{step}.{i}", prompt, 24, float(step)))
        plan = sched.schedule()
        for rid, pages in plan.swap_out:
            req = next(r for r in sched.waiting if r.request_id == rid)
            moved[rid] = (req.num_dropped_pages, alloc.pages_for(req.num_computed), len(pages))
            assert len(pages) == moved[rid][1] - moved[rid][0] > 0
            windowed_swaps += moved[rid][0] > 0
        for rid, pages in plan.swap_in:
            req = next(r for r in sched.running if r.request_id == rid)
            dropped, used, n = moved.pop(rid)  # the same positions: pages dropped..used
            assert req.num_dropped_pages == dropped and len(pages) == n
            assert tuple(req.page_ids[dropped:used]) == pages
        if not plan.is_empty:
            n = len(plan.decodes) + sum(c.samples for c in plan.prefills)
            for _, req in sched.update(plan, [7] * n):
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
        alloc.check()
        alloc.check_holders(sched.page_holders())
        for r in sched.running:
            _keys_match(alloc, r)
            assert len(r.held_page_ids) <= alloc.pages_held(len(r.all_token_ids))
        step += 1
    # The second and the long one (same first 34 tokens) each find the first's two pages.
    assert windowed_swaps > 0 and not moved and sched.prefix_hit_tokens == 2 * 32
    assert alloc.num_allocated == 0


# -- the memory plan -----------------------------------------------------------------------
def test_memory_plan_counts_a_windowed_request_by_its_window(engine):
    """16 sequence slots, a budget of 41 pages of 16 tokens, requests of max_model_len 256:
    unwindowed each holds 16 pages (2 fit); windowed at most ceil((24 + 32 + 14) / 16) = 5
    (8 fit), and the engine's pool is the plan's."""
    eng, _ = engine
    cfg = eng.model_config
    full_cfg = dataclasses.replace(cfg, layer_windows=())
    per_page = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * PS * cfg.head_dim * 4
    config = EngineConfig(**{**BASE, "max_num_seqs": 16}, kv_cache_bytes=41 * per_page)
    full, windowed = plan(full_cfg, config, compile=False), plan(cfg, config, compile=False)
    assert (full.num_kv_pages, windowed.num_kv_pages) == (41, 41)
    assert (full.pages_per_request(256), windowed.pages_per_request(256)) == (16, 5)
    assert (full.requests_at_once(), windowed.requests_at_once()) == (2, 8)
    assert windowed.requests_at_once(100) == 8 and windowed.pages_per_request(40) == 3
    assert "a request holds at most 5 pages, so 8 of max_model_len fit at once" \
        in windowed.summary()
    assert "sliding window" not in full.summary() and windowed.fits
    # The pool's cap is every slot at its most pages: 4 slots x 5 (and the sink).
    small = EngineConfig(**BASE, kv_cache_bytes=41 * per_page)
    assert plan(cfg, small, compile=False).num_kv_pages == 21
    eng = LLMEngine(cfg, eng.runner.params, eng.tokenizer, small)
    assert eng.allocator.pool_pages == 21 and eng.allocator.window == W


def test_plan_of_a_mistral_config(engine, tmp_path):
    """What ``jserve plan`` prints for a MistralForCausalLM config.json (the default model's
    shapes, sliding_window 24) in 41 pages: 4 requests of 256 tokens at once (the pool capped
    at 4 slots x 5 pages), where the same config with ``sliding_window`` null fits 2."""
    cfg = engine[0].model_config
    hf = {**cfg.to_hf_dict(), "architectures": ["MistralForCausalLM"],
          "model_type": "mistral", "sliding_window": W}
    hf.pop("layer_types")
    per_page = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * PS * cfg.head_dim * 4
    config = EngineConfig(**BASE, kv_cache_bytes=41 * per_page)
    plans = []
    for window in (W, None):
        path = tmp_path / f"{window}.json"
        path.write_text(json.dumps({**hf, "sliding_window": window}))
        plans.append(plan(read_config_file(path), config, compile=False))
    windowed, full = plans
    assert windowed.num_kv_pages == 21 and windowed.requests_at_once() == 4
    assert "sliding window            24 tokens: a request holds at most 5 pages, so 4 of " \
        "max_model_len fit at once" in windowed.summary()
    assert "4 requests of max_model_len at once" in windowed.log_line()
    assert (full.num_kv_pages, full.requests_at_once(), full.window) == (41, 2, None)

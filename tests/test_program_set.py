"""The fixed program set (docs/startup.md): the default engine compiles its whole
set before it is ready, at most 16 programs, and a mixed trace (heavy-tailed prompts up to
3,000 tokens, 1-200 output tokens, in waves) compiles nothing after that, XLA-wide; swapping
runs on two programs of the set whatever the page count; the CPU KV pool is sized from total
RAM, the same on every start."""
from __future__ import annotations

import numpy as np
import pytest

from harness.jax_events import EventRecorder
from harness.mixed_trace import mixed_trace
from jserve import LLM, SamplingParams
from jserve.kernels import resolve_impl
from llm_helpers import run_checked, small_llm

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # a compile or a cache read
EVENTS = EventRecorder()


def _compiles() -> int:
    return len(EVENTS.durations.get(BACKEND_COMPILE, []))


def _run_in_waves(eng, trace, steps_between: int) -> dict[str, list[int]]:
    """Each wave of ``trace`` (its arrival times) is added ``steps_between`` engine steps
    after the one before (deterministic, unlike wall-clock arrivals); runs to the end."""
    rng = np.random.default_rng(0)
    waves: dict[float, list] = {}
    for t in trace:
        waves.setdefault(t.arrival_s, []).append(t)
    done, ids = {}, {}
    for at in sorted(waves):
        for t in waves[at]:
            params = SamplingParams(temperature=0.0, max_tokens=t.output_tokens,
                                    ignore_eos=True)
            ids[eng.add_request(rng.integers(0, 256, t.prompt_tokens).tolist(), params)] = t
        for _ in range(steps_between):
            done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return {ids[rid].request_id: tokens for rid, tokens in done.items()}


@pytest.mark.slow
def test_a_mixed_trace_compiles_nothing_after_start():
    llm = LLM("default")  # default settings: warmup "all", the persistent cache
    eng = llm.engine
    programs, shapes = eng.runner.programs, eng.buckets.all_shapes()
    # 6 decode-only steps, prefill 16/32/64/128/256 (a CPU's ladder) with no or all 32
    # decode rows; the sampler; the swap gather and scatter.
    prefill = [16, 32, 64, 128, 256]
    assert sorted(shapes) == sorted([(0, p) for p in prefill] + [(32, p) for p in prefill]
                                    + [(d, 0) for d in (1, 2, 4, 8, 16, 32)])
    assert programs.compile_count == programs.compiled_up_front == 19
    assert set(programs.steps) == set(shapes) and programs.movers is not None
    assert eng.startup.cached + eng.startup.compiled == 19 and eng.startup.deferred == 0
    assert (f"on cpu (1 x cpu), attention {resolve_impl('auto')}, layers unrolled, dtype "
            "float32: ") in eng.startup.line()
    assert "(19 programs: " in eng.startup.line()

    trace = mixed_trace(num_requests=36, max_prompt=3000, max_output=200, waves=3, seed=1)
    before = _compiles()
    out = _run_in_waves(eng, trace, steps_between=6)
    assert _compiles() == before  # no XLA compile, nor a persistent-cache read, while serving
    assert programs.compile_count == 19 and not programs.padded
    assert {t.request_id: t.output_tokens for t in trace} == {
        rid: len(tokens) for rid, tokens in out.items()}
    ran = set(eng.runner.executed)
    assert ran <= set(shapes)
    # The trace mixes: decode-only steps, prefill alone and prefill beside decodes.
    assert any(p == 0 for _, p in ran) and (0, 256) in ran and (32, 256) in ran
    assert eng.allocator.num_allocated == 0


# 10 usable blocks of 16 tokens (default model: 4 layers x 2 KV heads x 64 x f32, K and V).
TINY_POOL = dict(kv_cache_bytes=11 * 2 * 4 * 2 * 16 * 64 * 4, max_model_len=160)


@pytest.mark.slow
def test_swapping_runs_on_the_programs_compiled_at_start():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 40, 100, 60)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [o.token_ids for o in small_llm().generate(prompts, greedy)]
    llm = small_llm(preemption="swap", warmup="all", **TINY_POOL)
    programs = llm.engine.runner.programs
    assert programs.movers is not None
    assert programs.compile_count == len(llm.engine.buckets.all_shapes()) + 1 + 2
    before = _compiles()
    assert run_checked(llm, prompts, greedy) == reference
    assert llm.engine.scheduler.num_swaps > 0
    assert _compiles() == before and programs.compile_count == programs.compiled_up_front


@pytest.mark.slow
def test_decode_bursts_compile_with_the_set():
    """With bursts on, the set is the one without (each all-decode shape's step runs its
    bursts): bursts run, nothing compiles, the tokens are one step at a time's."""
    prompts = [[5, 9, 11, 3, 7], list(range(1, 41)), [8] * 20]
    greedy = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    reference = [o.token_ids for o in small_llm(decode_burst=1).generate(prompts, greedy)]
    llm = small_llm(decode_burst=4, warmup="all")
    eng, programs = llm.engine, llm.engine.runner.programs
    assert programs.lowering.modes.burst_steps == 4
    assert sorted(programs.steps) == sorted(eng.buckets.all_shapes())
    assert programs.compile_count == len(eng.buckets.all_shapes()) + 1 + 2
    warm, before = programs.compile_count, _compiles()
    assert run_checked(llm, prompts, greedy) == reference
    assert any(plan.burst == 4 for plan, _ in eng.step_log)
    assert _compiles() == before and programs.compile_count == warm


@pytest.mark.parametrize("compiled", [False, True])
def test_pages_move_in_fixed_chunks_whatever_their_count(compiled):
    """A move of more pages than one chunk (``SWAP_CHUNK``) and of fewer: the pages read
    back are those written, the others untouched; the jitted functions and the programs
    compiled at start alike."""
    import jax

    from jserve.cache.pool import allocate_kv_cache
    from jserve.engine.batch.arrays import abstract_of
    from jserve.engine.device import page_io
    from jserve.model.weights import DEFAULT_CONFIG

    kv = allocate_kv_cache(DEFAULT_CONFIG, 100, 16)
    movers = None
    if compiled:
        gather, lower_scatter = page_io.lower_movers(abstract_of(kv), None)
        read = gather.compile()
        movers = page_io.PageMovers(read, lower_scatter(read).compile())
    rng = np.random.default_rng(0)
    pages = list(rng.permutation(np.arange(1, 100))[:page_io.SWAP_CHUNK * 2 + 5])
    shape = kv[0].shape[:2] + (len(pages),) + kv[0].shape[3:]
    data = tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    kv = page_io.write_pages(kv, pages, data, movers)
    back = page_io.read_pages(kv, pages, movers)
    for got, want in zip(back, data):
        np.testing.assert_array_equal(got, want)
    few = page_io.read_pages(kv, pages[3:6], movers)
    np.testing.assert_array_equal(few[1], data[1][:, :, 3:6])
    others = sorted(set(range(100)) - set(pages))
    for leaf in kv:
        assert not np.asarray(jax.device_get(leaf))[:, :, others].any()


def test_a_cpu_pool_is_sized_from_total_ram():
    """Free RAM moves with whatever else runs; the default pool (and every program's KV
    shape) must not."""
    from jserve.cache.pool import (
        CPU_KV_BUDGET_BYTES,
        cpu_kv_budget,
        kv_bytes_per_page,
        num_pages_for_budget,
        stable_page_count,
        total_host_bytes,
    )
    from jserve.config import ModelConfig
    cfg = ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=8192)
    per_page = kv_bytes_per_page(cfg, 16)
    for fraction in (0.05, 0.5):
        budget = cpu_kv_budget(fraction)
        assert budget == min(int(total_host_bytes() * fraction), CPU_KV_BUDGET_BYTES)
        assert num_pages_for_budget(cfg, 16, kv_cache_bytes=None, memory_fraction=fraction,
                                    max_useful_pages=10**7) == \
            stable_page_count(budget // per_page)

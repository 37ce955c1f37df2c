"""Start-up (docs/startup.md): which step programs compile before the engine is ready and
which later, and that a step whose shape is not compiled yet is served exactly (padded up to
a compiled shape while its own compiles in the background)."""
from __future__ import annotations

import re

import pytest

from hf_models import tiny_llama_dir
from jserve import SamplingParams
from jserve.engine.build.startup import StartupTimes
from llm_helpers import small_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Lengths that need a 16-token chunk first (one prompt alone), then mixed steps and decode
# batches of 2-4 rows (the small buckets: decodes 1, 2, 4; prefill tokens 16, 32).
PROMPTS = [[5, 9, 11, 3, 7], list(range(1, 41)), [8] * 20, [100, 200, 300]]


def _generate(llm) -> list[list[int]]:
    first = llm.generate(PROMPTS[:1], GREEDY)  # alone: a (0, 16) step, then 1-row decodes
    rest = llm.generate(PROMPTS[1:], GREEDY)
    return [o.token_ids for o in first + rest]


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_llama_dir("llama3"))  # an HF directory: weights stream while compiling


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """Every step shape compiled before the first request."""
    llm = small_llm(model_dir, warmup="all")
    runner = llm.engine.runner.programs
    # and the sampler and the two swap programs (page_io)
    assert runner.compile_count == len(llm.engine.buckets.all_shapes()) + 1 + 2
    out = _generate(llm)
    assert not runner.padded and runner.compile_count == runner.compiled_up_front
    return out


@pytest.mark.slow
def test_core_warmup_compiles_two_programs_and_the_rest_later(model_dir, reference):
    llm = small_llm(model_dir, warmup="core")
    eng, runner = llm.engine, llm.engine.runner.programs
    shapes = eng.buckets.all_shapes()
    assert sorted(shapes) == [(0, 16), (0, 32), (1, 0), (2, 0), (4, 0), (4, 16), (4, 32)]
    # Up front: the largest step (covers every other) and the 1-row decode, each sampling
    # in its own executable. The sampling executable alone (late structured-output masks)
    # is queued in the background at start; the 5 other shapes wait for first use.
    assert runner.compiled_up_front == 2
    assert sorted(runner.steps) == [(1, 0), (4, 32)]
    assert eng.startup.deferred == 6 and eng.startup.overlapped
    assert eng.startup.cached + eng.startup.compiled == 2
    runner.sampler()  # waits for the background compile: compiled once, not again here
    assert runner.compile_count == 3 and runner.compiled_later == 1

    assert _generate(llm) == reference  # exact greedy tokens, padded steps included
    # The lone 5-token prompt's chunk needed (0, 16), not compiled: it ran as the largest step.
    assert runner.padded[((0, 16), (4, 32))] == 1
    needed = {need for need, _ in runner.padded}
    assert all(ran[0] >= need[0] and ran[1] >= need[1] for need, ran in runner.padded)
    assert needed <= set(shapes) - {(1, 0), (4, 32)}
    assert runner.wait_compiles(timeout=600)
    # Each shape a step needed compiled once, in the background; nothing compiled twice.
    assert runner.compiled_later == 1 + len(needed) and runner.compile_count == 3 + len(needed)
    assert set(runner.steps) == needed | {(1, 0), (4, 32)}

    compiled, before = set(runner.steps), runner.padded.copy()
    assert _generate(llm) == reference  # the same steps again: on their own programs now
    assert all(need not in compiled for need, _ in runner.padded - before)
    eng.allocator.check()
    assert eng.allocator.num_allocated == 0


@pytest.mark.slow
def test_background_warmup_compiles_every_other_shape_after_ready(model_dir, reference):
    llm = small_llm(model_dir, warmup="background")
    runner = llm.engine.runner.programs
    assert runner.compiled_up_front == 2
    assert runner.wait_compiles(timeout=600)
    total = len(llm.engine.buckets.all_shapes()) + 1  # and the sampling executable
    assert runner.compile_count == total and runner.compiled_later == total - 2
    assert _generate(llm) == reference and not runner.padded
    assert runner.compile_count == total


def test_none_warmup_compiles_each_shape_on_first_use_and_waits(model_dir, reference):
    llm = small_llm(model_dir, warmup="none")
    runner = llm.engine.runner.programs
    assert runner.compile_count == 0 and runner.deferred is None
    assert _generate(llm) == reference and not runner.padded
    # The shapes used: each plain step samples in its own executable, so the sampling
    # executable (late masks, pipeline ticks) is never needed here and never compiled.
    assert runner.compile_count == len(runner.steps) and not runner.samplers


def test_warmup_modes_and_bools():
    from jserve.engine.config import EngineConfig
    assert EngineConfig().warmup == "all"
    assert EngineConfig(warmup=True).warmup == "all"
    assert EngineConfig(warmup=False).warmup == "none"
    with pytest.raises(ValueError, match="warmup must be one of"):
        EngineConfig(warmup="some")


def test_startup_line_names_every_phase():
    t = StartupTimes(before_engine=0.9, weights=0.4, kv=0.1, programs=1.6, cached=2,
                     compiled=1, deferred=16)
    t.engine = 2.3
    assert t.line() == ("ready in 3.2 s: imports 0.9, weights 0.4, KV 0.1, programs 1.6 "
                        "(3 programs: 2 cached, 1 compiled, 16 deferred)")
    t = StartupTimes(before_engine=0.9, weights=0.4, kv=0.1, programs=1.6, cached=12,
                     compiled=3, compile_seconds=2.04, threads=2, backend="gpu",
                     devices="1 x NVIDIA H200", attention="pallas_gpu", layer_mode="sliced",
                     dtype="bfloat16", dtype_reason="auto: bf16 checkpoint")
    t.engine = 2.3
    assert t.line() == (
        "ready in 3.2 s on gpu (1 x NVIDIA H200), attention pallas_gpu, layers sliced, dtype "
        "bfloat16 (auto: bf16 checkpoint): imports 0.9, weights 0.4, KV 0.1, programs 1.6 (15 "
        "programs: 12 cached, 3 compiled; 2.0 s of compiles over 2 threads)")
    assert re.fullmatch(r"\d+\.\d+", f"{StartupTimes().before_engine:.1f}")  # Linux /proc


def test_a_pool_sized_from_free_memory_keeps_its_size_across_restarts():
    """Free memory moves between starts; the pool (and so every program's shape, and the
    persistent cache key) must not move with it."""
    from jserve.cache.pool import stable_page_count
    assert stable_page_count(16200) == stable_page_count(15500) == 15360  # 4% apart
    for n in (2, 17, 100, 1000, 16385, 10**6 + 7):
        got = stable_page_count(n)
        assert n * 7 / 8 <= got <= n and stable_page_count(got) == got


def test_a_cpu_pool_without_a_budget_takes_at_most_4_gib():
    """Every page is zeroed at start: the CPU default is bounded, an explicit budget is not."""
    from jserve.cache.pool import CPU_KV_BUDGET_BYTES, kv_bytes_per_page, num_pages_for_budget
    from jserve.config import ModelConfig
    cfg = ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=8192)
    per_page = kv_bytes_per_page(cfg, 16)
    pages = num_pages_for_budget(cfg, 16, kv_cache_bytes=None, memory_fraction=1.0,
                                 max_useful_pages=10**7)
    assert pages * per_page <= CPU_KV_BUDGET_BYTES == 4 << 30
    explicit = num_pages_for_budget(cfg, 16, kv_cache_bytes=2 * CPU_KV_BUDGET_BYTES,
                                    memory_fraction=1.0, max_useful_pages=10**7)
    assert explicit * per_page == 2 * CPU_KV_BUDGET_BYTES

"""The engine with a quantized KV cache: the same ``kv_cache_bytes`` holds twice the tokens
(fp8) or 2D/(D+4) times (int8) of a bf16 model's pool, a prompt too long for the full-precision
pool fits and completes, and prefix caching, swap, kvp=2, spp=2 and tp=2 give the greedy
tokens of the one-device run of the same quantized configuration."""
from __future__ import annotations

import json
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from devices import run_on_devices
from jserve import SamplingParams
from llm_helpers import run_checked, small_llm

# One page of 16 tokens of the default model (4 layers, 2 KV heads, head_dim 64) in bf16,
# K and V.
BF16_PAGE = 2 * 4 * 2 * 16 * 64 * 2
BUDGET = 41 * BF16_PAGE


def _engine(kv_cache_dtype: str, **kw):
    return small_llm(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=BUDGET,
                     max_model_len=2048, **kw)


def test_same_budget_admits_twice_the_tokens():
    pools = {kind: _engine(kind).engine.allocator for kind in ("auto", "fp8_e4m3", "int8")}
    assert pools["auto"].total == 40
    # fp8: exactly half the bytes a token; int8: 64 values + a 4-byte scale per token and head.
    assert pools["fp8_e4m3"].total == 2 * 41 - 1
    assert pools["int8"].total == (BUDGET // (BF16_PAGE // 2 * 68 // 64)) - 1
    for alloc in pools.values():  # admission: every usable page can be taken at once
        taken = [alloc.allocate(1) for _ in range(alloc.total)]
        assert not alloc.can_allocate(1)
        for blocks in taken:
            alloc.free(blocks)
        alloc.check()
    assert pools["int8"].total >= 1.85 * pools["auto"].total


def test_a_prompt_too_long_for_full_precision_fits_quantized_and_completes():
    prompt = [3 + i % 250 for i in range(900)]  # 57 pages with 12 new tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = _engine("auto")
    with pytest.raises(ValueError, match="KV pages"):
        full.generate([prompt], params)
    assert full.engine.allocator.num_allocated == 0 and not full.engine.has_unfinished()
    for kind in ("int8", "fp8_e4m3"):
        (tokens,) = run_checked(_engine(kind), [prompt], params)
        assert len(tokens) == 12


_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from jserve import LLM, SamplingParams
    from harness.evaluate import release_executables
    runs = json.loads(sys.argv[1])
    settings = json.loads(sys.argv[2])
    prompts = [[3 + (7 * i + j) % 300 for j in range(n)]
               for i, n in enumerate((150, 9, 40, 3, 70))]
    prompts.append(prompts[0][:96] + [5, 6, 7, 8])  # shares 6 pages with the first prompt
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    result = {}
    for name, kw in runs.items():
        llm = LLM("default", **settings, **kw)
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        again = [o.token_ids for o in llm.generate(prompts, params)]
        eng = llm.engine
        eng.allocator.check()
        sched = eng.scheduler
        result[name] = {"tokens": tokens, "again": again, "swaps": sched.num_swaps,
                        "preemptions": sched.num_preemptions,
                        "hits": sched.prefix_hit_tokens, "leaked": eng.allocator.num_allocated,
                        "devices": len(jax.tree.leaves(eng.runner.kv_cache)[0].sharding.device_set),
                        "leaves": len(jax.tree.leaves(eng.runner.kv_cache))}
        del llm, eng
        release_executables()
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_cache_paths_and_meshes_match_one_device_with_quantized_pages():
    settings = dict(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_seqs=2,
                    max_model_len=256, warmup=False, page_size=16)
    runs = {}
    # Each kind's base and swap; the meshes run int8, whose scale leaves are what a mesh must
    # split beyond unquantized pages (fp8 pages have none).
    for kind in ("int8", "fp8_e4m3"):
        base = dict(kv_cache_dtype=kind)
        runs[f"{kind}|base"] = {**base, "enable_prefix_caching": False, "num_kv_pages": 65}
        runs[f"{kind}|swap"] = {**base, "enable_prefix_caching": False, "num_kv_pages": 13,
                                "preemption": "swap"}
    runs["int8|kvp=2"] = {"kv_cache_dtype": "int8", "mesh": "kvp=2", "num_kv_pages": 9}
    runs["int8|prefix"] = {"kv_cache_dtype": "int8", "num_kv_pages": 65}
    runs["int8|spp=2"] = {"kv_cache_dtype": "int8", "mesh": "spp=2", "num_kv_pages": 17}
    runs["int8|tp=2"] = {"kv_cache_dtype": "int8", "mesh": "tp=2", "num_kv_pages": 17}
    names = list(runs)
    halves = [names[0::2], names[1::2]]
    with ThreadPoolExecutor(2) as pool:
        out = pool.map(lambda part: run_on_devices(
            _SCRIPT, json.dumps({n: runs[n] for n in part}), json.dumps(settings),
            timeout=1200), halves)
        result = {name: r for proc in out for name, r in proc.result.items()}
    for name, got in result.items():
        kind, _, what = name.partition("|")
        base = result[f"{kind}|base"]
        assert got["tokens"] == base["tokens"] and got["again"] == base["tokens"], name
        assert got["leaked"] == 0 and got["leaves"] == (4 if kind == "int8" else 2), name
        assert got["devices"] == (1 if what in ("base", "swap", "prefix") else 2), name
    assert all(result[f"{k}|swap"]["swaps"] > 0 for k in ("int8", "fp8_e4m3"))
    assert result["int8|kvp=2"]["preemptions"] > 0
    assert result["int8|prefix"]["hits"] >= 96 + 150 // 16 * 16
    assert result["int8|base"]["preemptions"] == 0


def test_an_unknown_kv_cache_dtype_is_refused_up_front():
    from jserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        small_llm(kv_cache_dtype="fp16")

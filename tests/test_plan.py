"""``jserve plan``: memory plans compiled with abstract weights. Llama-3.1-70B at tp=8 on 8
simulated CPU devices plans, compiles and fits 80 GB with weight bytes within 1% of a count
from the sharding rules; at tp=1 it does not fit (exit 1); the default model's pool agrees
with what an engine allocates under the same KV settings (tp=1 here, tp=2 x kvp=2 in the
subprocess)."""
from __future__ import annotations

import dataclasses
import json
import textwrap

import jax
import pytest

from devices import run_on_devices
from jserve import LLM
from jserve.engine.build.memory_plan import describe_engine, parse_bytes, plan
from jserve.engine.config import EngineConfig
from jserve.model.weights import DEFAULT_CONFIG
from llm_helpers import SMALL

LLAMA_31_70B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": [128001, 128009],
    "hidden_act": "silu"}

# Small buckets keep the CPU compile cheap; the context is the real 8192.
PLAN_FLAGS = ["--max-model-len", "8192", "--max-num-seqs", "8", "--max-num-batched-tokens",
              "64", "--max-prefill-seqs", "2"]


def analytic_weight_bytes_per_device(c: dict, tp: int) -> int:
    """Megatron split: q/k/v/o and the MLP matrices split over tp, norms, embedding and
    lm_head replicated; bf16."""
    d, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    split = n * (d * q + 2 * d * kv + q * d + 3 * d * f) // tp
    replicated = n * 2 * d + 2 * v * d + d
    return 2 * (split + replicated)


_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax
    from jserve.cli import main
    from jserve.engine.config import EngineConfig
    from jserve.engine.build.memory_plan import describe_engine, plan
    from jserve.model.families import read_config_file

    config_path, flags = sys.argv[1], json.loads(sys.argv[2])
    cfg = read_config_file(config_path)
    settings = dict(max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=64,
                    max_prefill_seqs=2, warmup=False)
    out = {"devices": jax.device_count()}
    t0 = time.perf_counter()
    p = plan(cfg, EngineConfig(mesh="tp=8", **settings), device_memory_bytes=80 * 10**9)
    out["tp8"] = dict(seconds=time.perf_counter() - t0, weights=p.weight_bytes,
                      pages=p.num_kv_pages, fits=p.fits, tokens=p.max_cached_tokens,
                      temp=p.step.temp_bytes, per_page=p.kv_bytes_per_page,
                      summary=p.summary(), choices=[c.__dict__ for c in p.choices])
    p1 = plan(cfg, EngineConfig(mesh="tp=1", **settings), device_memory_bytes=80 * 10**9)
    out["tp1"] = dict(fits=p1.fits, summary=p1.summary(), suggested_tp=p1.suggested_tp)
    # The CLI on the same plans: exit 0 when it fits, 1 when it does not.
    out["cli_tp8"] = main(["plan", "--model", config_path, "--mesh", "tp=8", "--devices", "8",
                           "--device-memory", "80GB", *flags])
    out["cli_tp1"] = main(["plan", "--model", config_path, "--device-memory", "80GB", *flags])
    # tp x kvp on the default model: the plan's pool is the engine's.
    from jserve import LLM
    from jserve.model.weights import DEFAULT_CONFIG
    small = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                 max_model_len=512, warmup=False)
    kw = dict(mesh="tp=2,kvp=2", kv_cache_bytes=40 * 2 * 4 * 1 * 16 * 64 * 4, **small)
    engine = LLM("default", **kw).engine
    pk = plan(DEFAULT_CONFIG, EngineConfig(**kw))
    out["kvp"] = dict(plan=[pk.num_kv_pages, pk.max_cached_tokens, pk.weight_bytes],
                      engine=[engine.allocator.pool_pages,
                              engine.allocator.total * engine.allocator.page_size,
                              sum(x.addressable_shards[0].data.nbytes
                                  for x in jax.tree.leaves(engine.runner.params))],
                    line=describe_engine(engine))
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def seventy_b(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("llama70b") / "config.json"
    path.write_text(json.dumps(LLAMA_31_70B))
    proc = run_on_devices(_SCRIPT, str(path), json.dumps(PLAN_FLAGS), timeout=600)
    return {**proc.result, "stdout": proc.stdout}


@pytest.mark.slow
def test_llama_70b_tp8_plans_and_fits_80gb(seventy_b):
    r = seventy_b["tp8"]
    assert seventy_b["devices"] == 8
    expected = analytic_weight_bytes_per_device(LLAMA_31_70B, 8)
    assert abs(r["weights"] - expected) / expected < 0.01, (r["weights"], expected)
    assert 21e9 < r["weights"] < 22e9  # 17.1 GB split + 4.2 GB replicated embed and head
    assert r["fits"] and r["pages"] > 0, r["summary"]
    # One device's page: 2 (K, V) x 80 layers x 1 KV head x 16 tokens x 128 x 2 bytes.
    assert r["per_page"] == 2 * 80 * 1 * 16 * 128 * 2
    assert r["tokens"] == (r["pages"] - 1) * 16
    assert 0 < r["temp"] < 5e9  # the compiled step's temporaries, from memory_analysis()
    assert "FITS" in r["summary"] and "DOES NOT FIT" not in r["summary"]
    assert seventy_b["cli_tp8"] == 0


@pytest.mark.slow
def test_llama_70b_on_one_80gb_device_does_not_fit(seventy_b):
    r = seventy_b["tp1"]
    assert not r["fits"]
    assert "DOES NOT FIT" in r["summary"] and "use tp=8" in r["summary"], r["summary"]
    assert r["suggested_tp"] == 8  # tp=4: 38.4 GB of weights + activations > 40 GB
    assert seventy_b["cli_tp1"] == 1
    assert "DOES NOT FIT" in seventy_b["stdout"]


@pytest.mark.slow
def test_kvp_plan_matches_the_engine(seventy_b):
    r = seventy_b["kvp"]
    assert r["plan"] == r["engine"]
    assert f"KV {r['plan'][0]:,} pages" in r["line"] and "mesh tp=2,kvp=2" in r["line"]


@pytest.mark.slow
def test_llama_70b_tp8_plan_lists_what_quantized_weights_and_kv_buy(seventy_b):
    """Weights int8/fp8 halve the split matrices (not the embedding and head); KV int8 and
    fp8 store 132 and 128 of bf16's 256 bytes a head; the freed memory buys tokens."""
    r = seventy_b["tp8"]
    by = {(c["quantization"], c["kv_cache_dtype"]): c for c in r["choices"]}
    full, q8 = by["none", "auto"], by["int8", "int8"]
    assert full["weight_bytes"] == r["weights"] and full["max_cached_tokens"] >= r["tokens"]
    assert [by["none", kv]["kv_bytes_per_token"] for kv in ("auto", "int8", "fp8_e4m3")] == [
        2 * 80 * 256, 2 * 80 * 132, 2 * 80 * 128]
    split = 80 * (8192 * 8192 * 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672) // 8
    saved = full["weight_bytes"] - by["int8", "auto"]["weight_bytes"]
    assert 0.99 * split < saved < split  # a byte less per split weight, plus the scales
    assert by["fp8", "auto"]["weight_bytes"] == by["int8", "auto"]["weight_bytes"]
    assert by["none", "fp8_e4m3"]["max_cached_tokens"] >= 2 * full["max_cached_tokens"] - 16
    assert q8["max_cached_tokens"] > 2.2 * full["max_cached_tokens"]
    assert "weight and KV cache storage choices" in r["summary"]


def test_quantized_default_plan_matches_the_engine():
    kw = dict(SMALL, kv_cache_bytes=1_000_000, kv_cache_dtype="int8")
    eng = LLM("default", quantization="int8", **kw).engine
    p = plan(dataclasses.replace(DEFAULT_CONFIG, quantization="int8"), EngineConfig(**kw))
    assert p.num_kv_pages == eng.allocator.pool_pages
    assert p.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(eng.runner.params))
    full = plan(DEFAULT_CONFIG, EngineConfig(**{**kw, "kv_cache_dtype": "auto"}),
                compile=False)
    # f32 model, head_dim 64: 256 bytes a head and token against int8's 64 + 4.
    assert p.kv_bytes_per_page * 256 == full.kv_bytes_per_page * 68
    assert p.weight_bytes < full.weight_bytes
    mine = [c for c in p.choices if (c.quantization, c.kv_cache_dtype) == ("int8", "int8")]
    assert mine[0].weight_bytes == p.weight_bytes and mine[0].num_kv_pages == p.num_kv_pages


@pytest.mark.parametrize("kv", [dict(kv_cache_bytes=2_700_000), dict(num_kv_pages=40)])
def test_default_plan_matches_the_engine(kv):
    llm = LLM("default", **{**SMALL, **kv})
    eng = llm.engine
    p = plan(DEFAULT_CONFIG, EngineConfig(**{**SMALL, **kv}))
    assert p.num_kv_pages == eng.allocator.pool_pages
    assert p.max_cached_tokens == eng.allocator.total * eng.allocator.page_size
    assert p.max_model_len == eng.max_model_len
    assert p.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(eng.runner.params))
    assert p.fits and p.step.temp_bytes > 0
    line = describe_engine(eng)
    assert f"KV {p.num_kv_pages:,} pages" in line
    assert f"max cached tokens {p.max_cached_tokens:,}" in line


def test_too_few_pages_for_one_sequence_does_not_fit():
    p = plan(DEFAULT_CONFIG, EngineConfig(**{**SMALL, "num_kv_pages": 10}), compile=False)
    assert not p.fits and "max_model_len" in p.problems[0]


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10 ** 9
    assert parse_bytes("80GiB") == 80 * 2 ** 30
    assert parse_bytes("123") == 123
    assert parse_bytes("1.5 tb") == 1_500_000_000_000
    with pytest.raises(ValueError):
        parse_bytes("80 parsecs")

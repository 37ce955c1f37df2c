"""Model families beyond Llama (``jserve.model.families``) against HF transformers, on tiny
random checkpoints of unusual shapes (``hf_models.FAMILY_CONFIGS``): Qwen2/Qwen2.5 (q/k/v
biases, tied embeddings, GQA 6:1, head_dim 24), Qwen3 (q/k norms, GQA 6:2, head_dim 40
where hidden / heads is not an integer) and Gemma 3 (GQA 6:2, head_dim 20 beside hidden 96,
local layers of window 20 around a global one, two RoPE tables, capped logits: its prompts
of 14 and 45 tokens run past the window; more in test_gemma3).

The config reads as its family (parameter count equal to the torch model's, orbax round
trip); logits at every position match; greedy tokens equal ``generate``'s on one device with
the native CPU kernel, the reference and both Pallas kernels (interpreted), again when the
prompts come back through the prefix cache, and on tp=2, kvp=2 and spp=2 meshes (8 simulated
CPU devices). Quantized weights keep biases and q/k norms in full precision, stream as the
eager loader gives them and keep the logits close; int8 weights with int8 KV pages give the
same tokens on a tp x kvp x spp mesh as on one device. An architecture without a family is
refused at load, naming it and the supported list."""
from __future__ import annotations

import functools
import json
import textwrap

import jax
import numpy as np
import pytest
import torch

from devices import run_on_devices
from hf_models import FAMILY_CONFIGS, tiny_llama_dir, tiny_llama_model
from jserve import LLM, SamplingParams
from jserve.model import quant
from jserve.model.decoder import to_runtime_layout
from jserve.model.families import SUPPORTED_ARCHITECTURES, read_config_file
from jserve.model.params import num_params, param_shapes
from jserve.model.weights import load_hf_safetensors, load_model, save_orbax
from test_hf_parity import _all_position_logits

FAMILIES = sorted(FAMILY_CONFIGS)
# Lengths 14, 4 and 45: the last is three prefill chunks and two full pages of 16 (what the
# prefix cache can hand back).
PROMPTS = [[1, 5, 9, 200, 33, 7, 81, 64, 12, 400, 33, 77, 5, 9],
           [1, 300, 301, 302],
           [3 + (7 * j) % 500 for j in range(45)]]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_seqs=2, max_model_len=128,
              warmup=False)
# The quantized runs: Gemma 3's leaves quantize as Qwen3's (its norms never), and its windows
# and second RoPE table are what its runs show.
# The MoE families' expert stacks quantize like the dense matrices (a scale per expert and
# output column; their router and biases never).
QUANTIZED_FAMILIES = [f for f in FAMILIES if f != "gemma3"]
MOE_FAMILIES = tuple(f for f in FAMILIES if "num_experts_per_tok" in FAMILY_CONFIGS[f])
# Each family's own layer tensors beyond Llama's (and none of the other's).
OWN_LEAVES = {"qwen2": {"bq", "bk", "bv"}, "qwen3": {"q_norm", "k_norm"},
              "gemma3": {"q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"},
              "mixtral": {"router", "we_gate", "we_up", "we_down"},
              "qwen2_moe": {"bq", "bk", "bv", "router", "we_gate", "we_up", "we_down",
                            "ws_gate", "ws_up", "ws_down", "shared_gate"},
              "qwen3_moe": {"q_norm", "k_norm", "router", "we_gate", "we_up", "we_down"},
              "gpt_oss": {"bq", "bk", "bv", "bo", "sinks", "router", "router_bias", "we_gate",
                          "we_up", "we_down", "be_gate", "be_up", "be_down"}}


@functools.cache
def hf_tokens(family: str) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no EOS stop)."""
    model = tiny_llama_model(family)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_as_its_family_and_round_trips(family, tmp_path):
    model_dir = tiny_llama_dir(family)
    cfg = read_config_file(model_dir / "config.json")
    hf, model = FAMILY_CONFIGS[family], tiny_llama_model(family)
    assert (cfg.architecture, cfg.model_type) == (type(model).__name__, model.config.model_type)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    rope = hf["rope_parameters"]  # Gemma 3's: per layer type
    assert cfg.rope_theta == rope.get("full_attention", rope)["rope_theta"]
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    leaves = set(param_shapes(cfg)["layers"][0])
    assert OWN_LEAVES[family] <= leaves and not (set().union(*OWN_LEAVES.values())
                                                 - OWN_LEAVES[family]) & leaves
    assert num_params(cfg) == sum(p.numel() for p in tiny_llama_model(family).parameters())
    # An orbax checkpoint says its architecture and loads back as the same family.
    cfg, params, _ = load_model(str(model_dir))
    save_orbax(tmp_path / "ckpt", cfg, params)
    cfg2, params2, _ = load_model(str(tmp_path / "ckpt"))
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_architecture_without_a_family_is_refused_at_load(tmp_path):
    config = dict(FAMILY_CONFIGS["qwen3"], architectures=["FalconForCausalLM"],
                  model_type="falcon")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), **ENGINE)
    assert "FalconForCausalLM" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)
    assert len(SUPPORTED_ARCHITECTURES) == 9
    # A family's config that asks for what it cannot serve is refused by name too.
    hf = json.loads((tiny_llama_dir("qwen2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        dict(hf, layer_types=["full_attention", "chunked_attention"])))
    with pytest.raises(ValueError, match="layer_types.*chunked_attention"):
        LLM(str(tmp_path), **ENGINE)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    cfg, params, _ = load_model(str(tiny_llama_dir(family)))
    ids = PROMPTS[2] + PROMPTS[0]
    ours = _all_position_logits(cfg, params, ids)
    with torch.no_grad():
        theirs = tiny_llama_model(family)(torch.tensor([ids])).logits[0].numpy()
    # float32 summation-order noise on logits of magnitude up to ~4 (weights drawn wide).
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


# Each family on the native CPU kernel (``auto`` here) and the reference; the interpreted
# Pallas kernels (about a minute each here) paired crosswise, so that each family runs on one
# and each kernel sees one family's head size and GQA ratio.
# Gemma 3 on one Pallas kernel only: test_gemma3's chat runs it on the native CPU kernel
# (a prompt of four windows), test_sliding_window every kernel's windows.
# "auto" is the native CPU decode kernel with the reference's prefill; the reference's
# decode, which reads nothing a family changes, is test_kernels' (held to the same tokens).
IMPLS = [(family, "auto") for family in FAMILIES if family != "gemma3"]
IMPLS += [("qwen2", "pallas_gpu"), ("qwen3", "pallas_tpu"), ("gemma3", "pallas_gpu")]


@pytest.mark.slow
@pytest.mark.parametrize("family, impl", IMPLS)
def test_greedy_tokens_match_generate_also_from_the_prefix_cache(family, impl):
    want = hf_tokens(family)
    assert len({t for out in want for t in out}) > 10  # no constant stream: layers matter
    llm = LLM(str(tiny_llama_dir(family)), attention_impl=impl, **ENGINE)
    first = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == want
    again = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == want
    assert again[2].metrics.cached_tokens == 32  # its two full pages
    llm.engine.allocator.check()
    assert llm.engine.allocator.num_allocated == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", QUANTIZED_FAMILIES)
def test_quantized_weights_keep_biases_and_norms_stream_as_eager_and_stay_close(family):
    model_dir = tiny_llama_dir(family)
    cfg, lazy, _ = load_model(str(model_dir), quantization="int8", lazy=True)
    streamed = lazy.place(cfg)
    eager = to_runtime_layout(load_hf_safetensors(model_dir, cfg))
    for name, leaf in streamed["layers"].items():
        assert quant.is_quantized(leaf) == (name in quant.QUANTIZED_LEAVES), name
    for name in OWN_LEAVES[family] - set(quant.QUANTIZED_LEAVES):  # biases, norms, router
        if name in streamed["layers"]:  # (gpt-oss's be_gate/be_up: fused, be_gate_up)
            assert streamed["layers"][name].dtype == np.float32, name
    assert jax.tree.structure(streamed) == jax.tree.structure(eager)
    for a, b in zip(jax.tree.leaves(streamed), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # Close to the full-precision logits. Measured (int8): the median position's largest
    # error 2-3% of the largest logit in every family; the worst 3-10% dense, 7-28% MoE (a
    # token whose perturbed router flips an expert choice moves further: a discrete
    # choice, the router itself is never quantized); the same argmax at 93-98% of positions
    # dense, 85-95% MoE.
    ids = PROMPTS[2] + PROMPTS[0]
    ours = _all_position_logits(cfg, load_hf_safetensors(model_dir, cfg), ids)
    with torch.no_grad():
        theirs = tiny_llama_model(family)(torch.tensor([ids])).logits[0].numpy()
    err = np.abs(ours - theirs).max(-1) / np.abs(theirs).max()
    routed = family in MOE_FAMILIES
    assert np.median(err) < 0.05
    assert err.max() < (0.3 if routed else 0.2)
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > (0.8 if routed else 0.85)


_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from jserve import LLM, SamplingParams
    from harness.evaluate import release_executables
    runs, prompts, engine = (json.loads(a) for a in sys.argv[1:4])
    params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[4]), ignore_eos=True)
    result = {}
    for key, (model, mesh, extra) in runs.items():
        llm = LLM(model, mesh=mesh, **engine, **extra)
        outs = llm.generate(prompts, params)
        llm.engine.allocator.check()
        result[key] = {"tokens": [o.token_ids for o in outs],
                       "leaked": llm.engine.allocator.num_allocated,
                       "devices": len(jax.tree.leaves(llm.engine.runner.kv_cache)[0]
                                      .sharding.device_set)}
        del llm, outs
        release_executables()
    print(json.dumps(result))
""")
# Every mesh axis at once (8 devices): each family's own leaves split under tp, its layers
# under spp, its pages under kvp, in one engine per family (the axes one at a time, and their
# pairs, are tests/test_mesh_matrix.py's on Llama).
MESH = "spp=2,kvp=2,tp=2"
# Quantized runs, int8 weights and int8 KV pages at once: on one device and on every axis.
QUANTIZED = dict(quantization="int8", kv_cache_dtype="int8")
# Qwen2's biases split on tp beside quantized matrices (they stay float): the one family whose
# quantized leaves meet a new layout on a mesh (Llama's is test_weight_quant's).
MESH_QUANTIZED = ["qwen2"]


@pytest.mark.slow
def test_meshes_match_generate_and_quantized_runs_match_one_device():
    """One engine per family on the mesh, and Qwen2 quantized on one device and on the mesh,
    in one 8-device process."""
    runs = {f"{family}|{MESH}": (str(tiny_llama_dir(family)), MESH, {}) for family in FAMILIES}
    runs |= {f"{family}|{mesh}|int8": (str(tiny_llama_dir(family)), mesh, QUANTIZED)
             for family in MESH_QUANTIZED for mesh in ("tp=1", MESH)}
    result = run_on_devices(_SCRIPT, json.dumps(runs), json.dumps(PROMPTS), json.dumps(ENGINE),
                            str(MAX_TOKENS), timeout=1500).result
    assert all(r["leaked"] == 0 for r in result.values())
    for family in FAMILIES:
        got = result[f"{family}|{MESH}"]
        assert got["devices"] == 8
        assert got["tokens"] == hf_tokens(family), family
    for family in MESH_QUANTIZED:
        one, mesh = (result[f"{family}|{m}|int8"] for m in ("tp=1", MESH))
        assert (one["devices"], mesh["devices"]) == (1, 8)
        assert mesh["tokens"] == one["tokens"], family

"""Weight-only quantization (``jserve.model.quant``): per-output-channel rounding and the
quantized matmul, quantize-on-load from HF safetensors (streamed per tensor, equal to the
eager path), the quantized orbax checkpoint round trip, tp/spp sharding of the quantized
matrices and their scales, and the tiny-tasks model's exact-answer rate with quantized
weights and KV cache against full precision."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devices import run_on_devices
from jserve import LLM, SamplingParams
from jserve.model import quant
from jserve.model.decoder import to_runtime_layout
from jserve.model.weights import load_hf_runtime, load_hf_safetensors, load_model, save_orbax
from jserve.tokenizer import ByteTokenizer
from llm_helpers import SMALL
from test_streaming_load import write_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[3 + (5 * i + j) % 250 for j in range(n)] for i, n in enumerate((40, 7, 70))]


@pytest.mark.parametrize("kind, rel", [("int8", 0.5 / 127), ("fp8", 2.0 ** -4)])
def test_per_output_channel_rounding_and_matmul(kind, rel):
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(3, 48, 40)) * rng.uniform(0.01, 5, (3, 1, 40))).astype(np.float32)
    q = quant.quantize_weight(w, kind)
    assert q.qvalue.shape == w.shape and q.scale.shape == (3, 1, 40)
    assert q.qvalue.dtype == np.dtype(quant.qtype(kind)) and q.scale.dtype == np.float32
    back = np.asarray(q.qvalue, np.float32) * np.asarray(q.scale)
    amax = np.abs(w).max(axis=1, keepdims=True)
    bound = amax * rel if kind == "int8" else np.maximum(np.abs(w), amax / 448 * 2 ** -6) * rel
    assert np.all(np.abs(back - w) <= bound * (1 + 1e-6))
    x = jnp.asarray(rng.normal(size=(5, 48)), jnp.float32)
    layer = jax.tree.map(lambda a: a[1], q)
    np.testing.assert_allclose(quant.matmul(x, layer), x @ back[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(quant.matmul(x, w[1]), x @ w[1])  # plain weights untouched


def test_streamed_quantized_load_equals_the_eager_quantized_params(tmp_path: Path):
    """Quantize on load, one tensor at a time: the streaming loader (host quantization,
    device shards) and the eager loader give bitwise equal runtime params."""
    import dataclasses
    cfg = dataclasses.replace(write_checkpoint(tmp_path / "ckpt", "bfloat16"),
                              quantization="int8")
    got = load_hf_runtime(tmp_path / "ckpt", cfg)
    want = to_runtime_layout(load_hf_safetensors(tmp_path / "ckpt", cfg))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert got["layers"]["w_down"].qvalue.dtype == np.int8
    assert got["embed"].dtype == np.dtype(cfg.np_dtype)  # embeddings stay full precision


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_orbax_checkpoint_round_trips(tmp_path: Path, kind):
    cfg, params, _ = load_model("default", quantization=kind)
    save_orbax(tmp_path / "q", cfg, params, tokenizer=ByteTokenizer())
    assert json.loads((tmp_path / "q" / "config.json").read_text())[
        "jserve_quantization"] == kind
    cfg2, restored, _ = load_model(str(tmp_path / "q"))  # as stored
    assert cfg2.quantization == kind
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    fresh = LLM("default", quantization=kind, **SMALL).generate(PROMPTS, GREEDY)
    loaded = LLM(str(tmp_path / "q"), **SMALL).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in loaded] == [o.token_ids for o in fresh]
    other = "fp8" if kind == "int8" else "int8"
    with pytest.raises(ValueError, match="stored quantized"):
        load_model(str(tmp_path / "q"), quantization=other)


def test_quantized_weights_are_smaller_and_change_little():
    full = LLM("default", **SMALL)
    q8 = LLM("default", quantization="int8", **SMALL)
    nbytes = lambda llm: sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.params))
    assert nbytes(q8) < 0.4 * nbytes(full)  # f32 layers -> int8 (+ scales); embed/head f32
    with pytest.raises(ValueError, match="quantization"):
        LLM("default", quantization="int4", **SMALL)


_MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from jserve import LLM, SamplingParams
    from harness.evaluate import release_executables
    ckpt, prompts = sys.argv[1], json.loads(sys.argv[2])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                    max_model_len=256, warmup=False, kv_cache_dtype="int8")
    out = {}
    # tp and spp at once (each alone is the mesh matrix's, on float weights).
    for mesh in ("tp=1", "spp=2,tp=2"):
        llm = LLM(ckpt, quantization="int8", mesh=mesh, **settings)  # streamed, quantized
        layers = llm.engine.runner.params["layers"]
        wo = layers["wo"] if isinstance(layers, dict) else layers[0]["wo"]
        out[mesh] = {"tokens": [o.token_ids for o in llm.generate(prompts, params)],
                     "specs": None if mesh == "tp=1" else [
                         list(wo.qvalue.sharding.spec), list(wo.scale.sharding.spec)]}
        del llm
        release_executables()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_quantized_weights_streamed_onto_meshes_match_one_device(tmp_path: Path):
    write_checkpoint(tmp_path / "ckpt", "bfloat16")
    res = run_on_devices(_MESH_SCRIPT, str(tmp_path / "ckpt"),
                         json.dumps([p[:30] for p in PROMPTS]), timeout=900).result
    assert res["spp=2,tp=2"]["tokens"] == res["tp=1"]["tokens"]
    # wo is row-split on tp: its values split on the input rows, its per-output-channel
    # scales [.., 1, out] never on tp; under spp both split by stage.
    values, scales = res["spp=2,tp=2"]["specs"]
    assert "tp" in values and "tp" not in scales, (values, scales)
    assert values[0] == scales[0] == "spp", (values, scales)


def test_convert_writes_a_quantized_checkpoint_that_loads_as_stored(tmp_path: Path):
    from jserve.cli import main
    from jserve.model.weights import load_config
    assert main(["convert", "--model", "default", "--quantization", "int8",
                 "--out", str(tmp_path / "q")]) == 0
    assert load_config(str(tmp_path / "q")).quantization == "int8"
    assert main(["generate", "--model", str(tmp_path / "q"), "--max-tokens", "2",
                 "--quantization", "fp8", "hi"]) == 2  # refused: stored as int8

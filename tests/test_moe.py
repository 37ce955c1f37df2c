"""The mixture-of-experts block (jserve/model/moe.py) against a plain numpy reference: its
three ways of running the experts (gathered, all experts zeroed, grouped), routing ties,
every token on one expert; that a decode-sized step compiled for a GPU and a TPU reads only
the chosen experts' weights; and what MoE models refuse. Mixtral's tokens against
transformers, on one device and on a mesh, are test_model_families' (it is one of
``hf_models.FAMILY_CONFIGS``)."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from devices import run_on_devices
from hf_models import tiny_llama_dir
from jserve.model import moe
from jserve.model.params import active_params, num_params
from jserve.model.weights import DEFAULT_CONFIG

E, D, F, K = 8, 32, 48, 2


def _layer(seed: int = 0, router_scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)
    return {"router": w(D, E) * router_scale, "we_gate": w(E, D, F), "we_up": w(E, D, F),
            "we_down": w(E, F, D)}


def _silu_mlp(row: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray
              ) -> np.ndarray:
    g, u = row @ gate, row @ up
    return (g / (1 + np.exp(-g)) * u) @ down


def _reference(layer: dict[str, np.ndarray], x: np.ndarray, k: int = K,
               normalize: bool = True) -> np.ndarray:
    """Per token: softmax over the experts, the top k (ties to the lower index),
    renormalised when ``normalize``, the weighted sum of those experts' SiLU-gated MLPs;
    plus, where the layer has one, the shared expert's MLP times sigmoid(row @
    shared_gate)."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = row @ layer["router"]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[:k]
        w = p[chosen] / p[chosen].sum() if normalize else p[chosen]
        for e, we in zip(chosen, w):
            out[t] += we * _silu_mlp(row, layer["we_gate"][e], layer["we_up"][e],
                                     layer["we_down"][e])
        if "ws_down" in layer:
            gate = 1 / (1 + np.exp(-(row @ layer["shared_gate"])))
            out[t] += gate * _silu_mlp(row, layer["ws_gate"], layer["ws_up"], layer["ws_down"])
    return out


def _fused(layer: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The runtime layout: every expert's gate and up side by side (``tp_layout``)."""
    gate_up = np.concatenate([layer["we_gate"], layer["we_up"]], axis=-1)
    return {"router": layer["router"], "we_down": layer["we_down"],
            "we_gate_up": np.asarray(moe.side_by_side(jnp.asarray(gate_up)))}


def _run(way, layer, x):
    w, experts = moe.route(jnp.asarray(x) @ jnp.asarray(layer["router"]), K)
    layer = jax.tree.map(jnp.asarray, layer)
    return np.asarray(jax.jit(way, static_argnums=4)(layer, jnp.asarray(x), w, experts,
                                                    moe.silu_glu))


XLA_WAYS = [moe.gathered_experts, moe.all_experts, moe.grouped_experts]
WAYS = [*XLA_WAYS, moe.native_experts]  # the native CPU kernel (jserve.kernels.cpu_moe)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("fused", [False, True])
def test_both_ways_equal_the_reference(way, fused):
    layer = _layer()
    x = np.random.default_rng(1).normal(0, 1, (13, D)).astype(np.float32)
    want = _reference(layer, x)
    got = _run(way, _fused(layer) if fused else layer, x)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # The block as the layer calls it (on a CPU: the native kernel).
    block = jax.jit(moe.moe_mlp, static_argnums=2)(
        jax.tree.map(jnp.asarray, _fused(layer) if fused else layer), jnp.asarray(x), K)
    np.testing.assert_allclose(np.asarray(block), want, atol=2e-5, rtol=1e-5)
    # The tokens spread over the experts (the case where grouping matters).
    _, experts = moe.route(jnp.asarray(x @ layer["router"]), K)
    assert len(set(np.asarray(experts).ravel().tolist())) >= E // 2


def test_routing_ties_go_to_the_lower_experts_and_one_hot_batches_are_exact():
    """A zero router ties every expert (each token takes experts 0 and 1 at half weight);
    a router that favours expert 5 for every token sends the whole batch to it (one group
    holds every row, the others none)."""
    x = np.random.default_rng(2).normal(0, 1, (9, D)).astype(np.float32)
    tied = _layer(router_scale=0.0)
    w, experts = moe.route(jnp.asarray(x @ tied["router"]), K)
    assert np.asarray(experts).tolist() == [[0, 1]] * 9
    np.testing.assert_array_equal(np.asarray(w), 0.5)
    one = _layer(3)
    one["router"][:, 5] += 50.0 * np.sign(x.mean(axis=0))  # logit 5 far above the rest
    _, experts = moe.route(jnp.asarray(x @ one["router"]), K)
    assert (np.asarray(experts)[:, 0] == 5).all()
    for layer in (tied, one):
        want = _reference(layer, x)
        for way in WAYS:
            np.testing.assert_allclose(_run(way, layer, x), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens", [2, 13])  # gathered at 2 tokens on a GPU/TPU; every expert
def test_unnormalised_routing_and_a_shared_expert_equal_the_reference(tokens):
    """Qwen2-MoE's block: the top-k softmax weights as they are (``norm_topk_prob`` false)
    and a shared expert under a per-token sigmoid gate, through the layer's ``moe_block``
    on the runtime layout (the shared expert's gate and up fused like a dense MLP's)."""
    from jserve.model.layers import moe_block

    rng = np.random.default_rng(4)
    w = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)
    layer = {**_layer(5), "ws_gate": w(D, 40), "ws_up": w(D, 40), "ws_down": w(40, D),
             "shared_gate": w(D, 1) * 3}
    x = rng.normal(0, 1, (tokens, D)).astype(np.float32)
    want = _reference(layer, x, normalize=False)
    assert np.abs(want - _reference(layer, x)).max() > 0.1  # renormalising would show
    runtime = {**_fused(layer), "ws_down": layer["ws_down"], "shared_gate": layer["shared_gate"],
               "ws_gate_up": np.concatenate([layer["ws_gate"], layer["ws_up"]], axis=-1)}
    cfg = dataclasses.replace(DEFAULT_CONFIG, num_experts=E, num_experts_per_tok=K,
                              moe_intermediate_size=F, norm_topk_prob=False,
                              shared_expert_size=40)
    for params in (runtime, layer):
        got = jax.jit(lambda l, h: moe_block(l, h, cfg))(jax.tree.map(jnp.asarray, params),
                                                         jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-5)
    for way in WAYS:  # each way with the weights unnormalised
        weights, experts = moe.route(jnp.asarray(x @ layer["router"]), K, normalize=False)
        got = jax.jit(way, static_argnums=4)(jax.tree.map(jnp.asarray, _fused(layer)),
                                             jnp.asarray(x), weights, experts, moe.silu_glu)
        np.testing.assert_allclose(np.asarray(got), _reference(
            {k: v for k, v in layer.items() if not k.startswith(("ws_", "shared"))}, x,
            normalize=False), atol=2e-5, rtol=1e-5)


def test_qwen_moe_configs_with_dense_layers_are_refused_by_name():
    """A Qwen MoE config whose ``decoder_sparse_step`` or ``mlp_only_layers`` leaves a layer
    dense is refused, naming the layers; every layer sparse reads."""
    from jserve.model.families import read_config

    hf = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=512, hidden_size=64,
              intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, norm_topk_prob=True)
    cfg = read_config(hf)
    assert (cfg.num_experts, cfg.expert_size, cfg.norm_topk_prob) == (8, 32, True)
    assert cfg.mlp_widths == {"moe_intermediate_size": 32}
    with pytest.raises(ValueError, match=r"layers \[0, 2\] dense.*decoder_sparse_step=2"):
        read_config(dict(hf, decoder_sparse_step=2))
    with pytest.raises(ValueError, match=r"layers \[3\] dense.*mlp_only_layers=\[3\]"):
        read_config(dict(hf, mlp_only_layers=[3]))
    with pytest.raises(ValueError, match="num_experts must be a positive integer"):
        read_config(dict(hf, num_experts=0))
    two = dict(hf, architectures=["Qwen2MoeForCausalLM"], shared_expert_intermediate_size=48)
    assert read_config(two).mlp_widths == {"moe_intermediate_size": 32,
                                           "shared_expert_intermediate_size": 48}
    with pytest.raises(ValueError, match="qkv_bias=false"):
        read_config(dict(two, qkv_bias=False))


def test_a_decode_step_gathers_and_a_prefill_groups():
    assert moe.gathers(1, 2, 8) and moe.gathers(3, 2, 8)
    assert not moe.gathers(4, 2, 8) and not moe.gathers(512, 8, 128)
    assert moe.gathers(15, 8, 128) and not moe.gathers(16, 8, 128)


def _dot_operand_sizes(hlo: str) -> list[int]:
    """The element count of every operand of every dot in a compiled HLO module's text
    (instruction names are unique in a module: the operands are looked up by name)."""
    sizes = {m[1]: math.prod(int(n) for n in m[2].split(",") if n)
             for m in re.finditer(r"(%[\w.\-]+) = \w+\[([\d,]*)\]", hlo)}
    return [sizes[name] for m in re.finditer(r" dot\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)
            for name in m.groups()]


@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_a_one_token_step_reads_only_its_experts_weights_on_gpu_and_tpu(target):
    """The block compiled for an H100 and a v5e (compile-only devices, ``jserve.targets``):
    at one token it gathers its k=2 experts' matrices and no dot reads all 8 experts'; at
    64 tokens a v5e runs XLA:TPU's own grouped matmul (ragged-dot). On a CPU the grouped
    way at one token has a dot over every expert (XLA:CPU expands ragged_dot into a masked
    dot), which is why a CPU never takes it."""
    from jserve.model.layer_weights import layer_view, reading_in_place
    from jserve.targets.specs import devices

    on = jax.sharding.SingleDeviceSharding(devices(target)[0])
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=on)
    layer = {"router": s(D, E), "we_gate_up": s(D, E * 2 * F), "we_down": s(E, F, D)}
    block = jax.jit(lambda l, h: moe.moe_mlp(l, h, K))
    one = block.lower(layer, s(1, D)).compile().as_text()
    assert "gather" in one and max(_dot_operand_sizes(one), default=0) < E * D * 2 * F
    many = block.lower(layer, s(64, D)).compile().as_text()
    assert ("ragged-dot" in many) == (target == "v5e")
    if target != "h100":
        return
    # On an H100, read in place from 4 stacked layers (the indexed layer loop's): no
    # instruction makes anything as large as one layer's gate/up experts. (A v5e relays
    # the whole stack out, layer axis minor, for the column-block gather: a gap,
    # docs/models.md.)
    stacked = {n: s(4, *w.shape) for n, w in layer.items()}

    def in_place(layers, i, h):
        with reading_in_place():
            return moe.moe_mlp(layer_view(layers, i), h, K)
    text = jax.jit(in_place).lower(stacked, jax.ShapeDtypeStruct((), jnp.int32, sharding=on),
                                   s(1, D)).compile().as_text()
    made = re.findall(r"^\s+(?:ROOT )?%\S+ = \(?bf16\[([\d,]*)\]\S* (?!parameter\()",
                      text, re.M)  # every instruction's (first) result but the parameters
    sizes = [math.prod(int(n) for n in dims.split(",") if n) for dims in made]
    assert sizes and max(sizes) < D * E * 2 * F, max(sizes)

    cpu = jax.tree.map(jnp.asarray, _fused(_layer()))
    grouped = lambda l, h: moe.grouped_experts(l, h, *moe.route(h @ l["router"], K),
                                               moe.silu_glu)
    text = jax.jit(grouped).lower(cpu, jnp.zeros((1, D), jnp.float32)).compile().as_text()
    assert max(_dot_operand_sizes(text)) >= cpu["we_gate_up"].size


@pytest.mark.parametrize("way", WAYS)
def test_expert_biases_and_the_clamped_swiglu_equal_the_reference(way):
    """gpt-oss's experts in every way: gate/up biases as one-row matrices in the fused
    layout, down biases weighted by the router, the clamped SwiGLU; against numpy."""
    rng = np.random.default_rng(4)
    layer = _layer()
    b_gate, b_up, b_down = (rng.normal(0, 0.5, s).astype(np.float32)
                            for s in ((E, 1, F), (E, 1, F), (E, D)))
    x = np.random.default_rng(1).normal(0, 1, (13, D)).astype(np.float32)
    limit, alpha = 1.0, 1.702
    want = np.zeros_like(x)
    for t, row in enumerate(x):
        w, chosen = moe.route(jnp.asarray(row[None] @ layer["router"]), K)
        for e, we in zip(np.asarray(chosen)[0], np.asarray(w)[0]):
            g = np.minimum(row @ layer["we_gate"][e] + b_gate[e, 0], limit)
            u = np.clip(row @ layer["we_up"][e] + b_up[e, 0], -limit, limit)
            want[t] += we * (((u + 1) * g / (1 + np.exp(-alpha * g))) @ layer["we_down"][e]
                             + b_down[e])
    biased = dict(_fused(layer), be_gate_up=np.asarray(moe.side_by_side(jnp.asarray(
        np.concatenate([b_gate, b_up], axis=-1)))), be_down=b_down)
    glu = moe.clamped_swiglu(limit, alpha)
    w, experts = moe.route(jnp.asarray(x) @ jnp.asarray(layer["router"]), K)
    got = jax.jit(way, static_argnums=4)(jax.tree.map(jnp.asarray, biased), jnp.asarray(x),
                                         w, experts, glu)
    got = np.asarray(got) + np.asarray(moe.down_bias(biased, w, experts, None))
    np.testing.assert_allclose(got, want, atol=3e-5, rtol=1e-5)
    assert np.abs(x @ layer["we_gate"][0] + b_gate[0, 0]).max() > limit  # the clamp bites


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("way", WAYS)
def test_quantized_experts_equal_the_reference_on_their_dequantized_weights(way, quantization):
    """Every way on experts quantized as the loaders store them (a scale per expert and
    output column): equal to the float reference on the dequantized weights, so the
    scales are applied where they belong; and close to the unquantized block."""
    from jserve.model import quant

    layer = _layer()
    x = np.random.default_rng(1).normal(0, 1, (13, D)).astype(np.float32)
    fused = {name: quant.quantize_weight(w, quantization) if name.startswith("we_") else
             jnp.asarray(w) for name, w in _fused(layer).items()}
    assert quant.is_quantized(fused["we_down"]) and fused["we_down"].scale.shape == (E, 1, D)
    dequantized = {n: np.asarray(w.qvalue.astype(jnp.float32) * w.scale)
                   if quant.is_quantized(w) else np.asarray(w) for n, w in fused.items()}
    gate, up = np.split(dequantized.pop("we_gate_up").reshape(D, E, 2 * F), 2, axis=-1)
    reference = dict(dequantized, we_gate=gate.transpose(1, 0, 2), we_up=up.transpose(1, 0, 2))
    w, experts = moe.route(jnp.asarray(x) @ jnp.asarray(layer["router"]), K)
    got = jax.jit(way, static_argnums=4)(fused, jnp.asarray(x), w, experts, moe.silu_glu)
    np.testing.assert_allclose(np.asarray(got), _reference(reference, x), atol=3e-5,
                               rtol=1e-5)
    off = np.abs(np.asarray(got) - _reference(layer, x)).max() / np.abs(_reference(layer, x)).max()
    assert 0 < off < {"int8": 0.02, "fp8": 0.1}[quantization]


def test_moe_config_checks():
    with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..4"):
        dataclasses.replace(DEFAULT_CONFIG, num_experts=4, num_experts_per_tok=5)


def test_the_memory_plan_of_an_moe_model_counts_total_and_active_parameters():
    from jserve.engine.build.memory_plan import plan

    cfg = dataclasses.replace(DEFAULT_CONFIG, architecture="MixtralForCausalLM",
                              model_type="mixtral", num_experts=4, num_experts_per_tok=2)
    p = plan(cfg, device_memory_bytes=2**30, compile=False)
    assert {c.quantization for c in p.choices} == {"none", "int8", "fp8"}
    # Total and active parameters: a token reads 2 of the 4 experts' three matrices.
    d, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    assert p.num_params - p.active_params == n * 3 * d * f * 2
    assert p.num_params == num_params(cfg) and p.active_params == active_params(cfg)
    assert f"{p.active_params / 1e6:.2f} M active a token" in p.summary()
    assert active_params(DEFAULT_CONFIG) == num_params(DEFAULT_CONFIG)
    assert "active" not in plan(DEFAULT_CONFIG, device_memory_bytes=2**30,
                                compile=False).summary().split("\n")[1]
    # The estimated predictor prices a token by its active parameters.
    from jserve.engine.loop.timing import estimated_predictor
    ratio = estimated_predictor(cfg).coef[1] / estimated_predictor(DEFAULT_CONFIG).coef[1]
    assert ratio == pytest.approx(active_params(cfg) / num_params(DEFAULT_CONFIG))
    assert {c.kv_cache_dtype for c in p.choices} == {"auto", "int8", "fp8_e4m3"}


@pytest.mark.slow
def test_a_served_qwen3_moe_chat_answers_with_transformers_tokens_and_calls_tools():
    """A real ``jserve serve`` of a Qwen3-MoE ChatML checkpoint (trained BPE tokenizer,
    Hermes tool template) through the official ``openai`` client: a greedy chat's prompt is
    ``apply_chat_template``'s and its text is the decoding of transformers' ``generate``;
    ``tool_choice: required`` answers with calls whose arguments validate."""
    import jsonschema
    import openai
    import torch
    import transformers

    from conftest import Served
    from hf_models import qwen3_moe_chat_dir
    from test_tool_calling import TOOLS

    path = qwen3_moe_chat_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    messages = [{"role": "user", "content": "What is the weather in Oslo for two days?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    want = tok.decode(out, skip_special_tokens=True)
    assert len(set(out)) > 4  # the experts' choices vary: not one repeated token
    s = Served(str(path), "--served-model-name", "qwen3-moe", "--tool-call-parser", "hermes",
               "--max-model-len", "1024", "--max-num-batched-tokens", "128")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0,
                               timeout=300)
        r = client.chat.completions.create(model="qwen3-moe", messages=messages,
                                           temperature=0.0, max_tokens=16,
                                           extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 16
        assert r.choices[0].message.content == want
        call = client.chat.completions.create(model="qwen3-moe", messages=messages,
                                              tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=3, max_tokens=400)
        assert call.choices[0].finish_reason == "tool_calls"
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for c in call.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    finally:
        s.close()


_EP_BLOCK = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from jserve.model import moe
from jserve.model.tp_layout import layer_axes, tp_layout_leaf
from jserve.model.weights import DEFAULT_CONFIG
from sharding.mesh import MeshConfig, make_mesh
meshes, k, out = sys.argv[1].split(";"), 2, {}
for path in sys.argv[2:]:
    arrays = np.load(path)
    (d, e), f = arrays["router"].shape, arrays["we_down"].shape[1]
    cfg = DEFAULT_CONFIG.__class__(**{**DEFAULT_CONFIG.__dict__, "hidden_size": d,
                                      "num_experts": e, "num_experts_per_tok": k,
                                      "moe_intermediate_size": f})
    for mesh in meshes:
        mc = MeshConfig.parse(mesh)
        # The tp layout of the fused gate/up columns (each tp shard's slice of every expert).
        layer = {n: jnp.asarray(tp_layout_leaf(n, arrays[n][None], cfg, mc.tp)[0])
                 for n in arrays.files if n != "x"}
        specs = {n: P(*layer_axes(n)[1:]) for n in layer}  # less the stacked layer axis
        f = jax.shard_map(lambda l, h: jax.lax.psum(moe.moe_mlp(l, h, k), "tp"),
                          mesh=make_mesh(mc), in_specs=(specs, P()), out_specs=P(),
                          check_vma=False)
        out[f"{path}|{mesh}"] = np.asarray(jax.jit(f)(layer, jnp.asarray(arrays["x"]))).tolist()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_experts_split_over_ep_give_the_reference_block(tmp_path):
    """The block with its experts split over ``ep`` (whole experts a shard, each shard's
    output summed over ep) beside tp, on 8 CPU devices: equal to the reference for spread
    tokens and for a batch that all picks expert 5 (on ep=4 three shards hold none of its
    pairs, on ep=8 every shard holds one expert), at 13 tokens and at 1."""
    spread, one = _layer(), _layer(3)
    x = np.random.default_rng(2).normal(0, 1, (13, D)).astype(np.float32)
    one["router"][:, 5] += 50.0 * np.sign(x.mean(axis=0))
    meshes = ["ep=2", "ep=2,tp=2", "ep=4,tp=2", "ep=8"]
    cases = {}
    for name, layer in (("spread", spread), ("one", one)):
        for rows in (x, x[:1]):
            path = str(tmp_path / f"{name}{len(rows)}.npz")
            np.savez(path, x=rows, **_fused(layer))
            cases[path] = _reference(layer, rows)
    got = run_on_devices(_EP_BLOCK, ";".join(meshes), *cases).result
    for path, want in cases.items():
        for mesh in meshes:
            np.testing.assert_allclose(np.asarray(got[f"{path}|{mesh}"]), want, atol=3e-5,
                                       rtol=1e-5, err_msg=f"{path} {mesh}")


@pytest.mark.slow
def test_moe_families_on_ep_meshes_match_generate():
    """Each MoE family's greedy tokens on meshes with ``ep`` (8 CPU devices, one process):
    Qwen2-MoE on ep=2,tp=2 (its shared expert split by tp, its experts by ep and tp),
    Qwen3-MoE on ep=4 (two of its eight experts a shard, top-3), Mixtral on
    ep=2,kvp=2,spp=2 (ep beside the KV-cache and pipeline axes), gpt-oss on ep=2,tp=2 (its
    expert biases split as their matrices, the down biases and sinks added once); and gpt-oss
    with int8 experts (and int8 KV pages) on ep=2,tp=2 as on one device, where its
    windowed and full layers keep two KV page groups."""
    from test_model_families import _SCRIPT, ENGINE, MAX_TOKENS, PROMPTS, hf_tokens

    runs = {"qwen2_moe": "ep=2,tp=2", "qwen3_moe": "ep=4", "mixtral": "ep=2,kvp=2,spp=2",
            "gpt_oss": "ep=2,tp=2"}
    int8 = dict(quantization="int8", kv_cache_dtype="int8")
    quantized = {f"gpt_oss|int8|{mesh}": (str(tiny_llama_dir("gpt_oss")), mesh, int8)
                 for mesh in ("tp=1", "ep=2,tp=2")}
    result = run_on_devices(_SCRIPT, json.dumps({
        f: (str(tiny_llama_dir(f)), mesh, {}) for f, mesh in runs.items()} | quantized),
        json.dumps(PROMPTS), json.dumps(ENGINE), str(MAX_TOKENS), timeout=1500).result
    one, ep = (result[f"gpt_oss|int8|{mesh}"] for mesh in ("tp=1", "ep=2,tp=2"))
    assert (one["devices"], ep["devices"], one["leaked"], ep["leaked"]) == (1, 4, 0, 0)
    assert ep["tokens"] == one["tokens"]
    for family, mesh in runs.items():
        got = result[family]
        assert got["leaked"] == 0
        assert got["devices"] == {"ep=2,tp=2": 4, "ep=4": 4, "ep=2,kvp=2,spp=2": 8}[mesh]
        assert got["tokens"] == hf_tokens(family), family


def test_ep_is_refused_for_dense_models_and_experts_it_does_not_divide():
    from sharding.mesh import MeshConfig

    moe_cfg = dataclasses.replace(DEFAULT_CONFIG, architecture="MixtralForCausalLM",
                                  num_experts=6, num_experts_per_tok=2)
    MeshConfig.parse("ep=3,tp=2").validate(moe_cfg)
    with pytest.raises(ValueError, match="ep=4 does not divide num_experts=6"):
        MeshConfig.parse("ep=4").validate(moe_cfg)
    with pytest.raises(ValueError, match="ep=2 splits experts, and this model has none"):
        MeshConfig.parse("ep=2").validate(DEFAULT_CONFIG)

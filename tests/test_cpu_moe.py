"""The native CPU experts kernel (jserve/kernels/cpu_moe.py, native/cpu_moe.cc) against a
numpy reference: every path through it (one to three rows an expert streamed, register tiles
of six over packed panels, column tails that are no multiple of a tile), bfloat16 experts,
a traced layer of stacked experts read in place, the expert biases and clamped SwiGLU of
gpt-oss, pairs of weight 0 (another ep shard's) left out; and that a CPU step takes it at
every token count, on int8 and fp8 experts too."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.kernels import cpu_moe
from jserve.model import moe
from jserve.model.layer_weights import layer_view, reading_in_place

TARGET = "jserve_cpu_moe_experts"


def _case(seed: int, e: int, d: int, f: int, layers: int = 1):
    rng = np.random.default_rng(seed)
    w = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)
    return w(layers, e, d, f), w(layers, e, d, f), w(layers, e, f, d)


def _stacks(gate, up, down):
    """The runtime leaves of stacked layers: we_gate_up [L, d, E * 2f], we_down [L, E, f, d]."""
    fused = np.concatenate([gate, up], axis=-1)  # [L, E, d, 2f]
    return np.transpose(fused, (0, 2, 1, 3)).reshape(fused.shape[0], fused.shape[2], -1), down


def _want(x, weights, experts, gate, up, down, glu=None, b_gate=None, b_up=None):
    """Per token, the weighted sum over its pairs of weight != 0 of that expert's MLP."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        for we, e in zip(weights[t], experts[t]):
            if we == 0:
                continue
            g, u = row @ gate[e], row @ up[e]
            if b_gate is not None:
                g, u = g + b_gate[e], u + b_up[e]
            act = g / (1 + np.exp(-g)) * u if glu is None else glu(g, u)
            out[t] += we * (act @ down[e])
    return out


@pytest.mark.parametrize("tokens, e, k, d, f, one_expert", [
    (1, 8, 2, 64, 96, False),     # a decode step: one row an expert, streamed
    (5, 4, 2, 40, 36, False),     # two or three rows an expert, tails of 8 and 4 columns
    (70, 8, 2, 48, 72, False),    # register tiles of six over packed panels, tails
    (29, 6, 3, 24, 20, True),     # every token's first choice one expert: 29 rows on it
])
def test_the_kernel_equals_the_reference(tokens, e, k, d, f, one_expert):
    gate, up, down = _case(tokens + e, e, d, f)
    rng = np.random.default_rng(tokens)
    x = rng.normal(0, 1, (tokens, d)).astype(np.float32)
    others = [j for j in range(e) if j != 2]
    experts = np.stack([[2, *rng.permutation(others)[:k - 1]] if one_expert
                        else rng.permutation(e)[:k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (tokens, k)).astype(np.float32)
    gate_up, down_s = _stacks(gate, up, down)
    got = cpu_moe.routed_experts(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                                 jnp.asarray(gate_up), jnp.asarray(down_s), 0, cpu_moe.SILU)
    np.testing.assert_allclose(np.asarray(got), _want(x, weights, experts, gate[0], up[0],
                                                      down[0]), atol=3e-5, rtol=1e-5)


def test_bfloat16_experts_and_pairs_of_weight_zero():
    """bfloat16 stacks are read as their float32 values; a pair of weight 0 (an ep shard's
    pair of another shard's expert, at index 0) adds nothing, however large its MLP."""
    e, k, d, f = 8, 2, 32, 48
    gate, up, down = _case(3, e, d, f)
    gate, up, down = (np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
                      for a in (gate, up, down))
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (20, d)).astype(np.float32)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(20)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (20, k)).astype(np.float32)
    weights[::3, 1] = 0
    experts[::3, 1] = 0
    gate_up, down_s = _stacks(gate, up, down)
    got = cpu_moe.routed_experts(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
                                 jnp.asarray(gate_up, jnp.bfloat16),
                                 jnp.asarray(down_s, jnp.bfloat16), 0, cpu_moe.SILU)
    np.testing.assert_allclose(np.asarray(got), _want(x, weights, experts, gate[0], up[0],
                                                      down[0]), atol=3e-5, rtol=1e-5)


def test_a_traced_layer_of_stacked_experts_with_biases_and_the_clamped_swiglu():
    """The indexed layer loop's in-place read (``LayerOf``) at a traced layer of three,
    through the block's own choice on a CPU, with gpt-oss's gate/up biases and activation
    (``be_down`` is added by the block outside the kernel)."""
    e, k, d, f, layers = 8, 2, 32, 40, 3
    gate, up, down = _case(5, e, d, f, layers)
    rng = np.random.default_rng(5)
    b_gate, b_up = (rng.normal(0, 0.5, (layers, e, f)).astype(np.float32) for _ in range(2))
    gate_up, down_s = _stacks(gate, up, down)
    biases = np.concatenate([b_gate, b_up], axis=-1)[:, :, None]  # [L, E, 1, 2f]
    stacked = {"router": rng.normal(0, 1, (layers, d, e)).astype(np.float32),
               "we_gate_up": gate_up, "we_down": down_s,
               "be_gate_up": np.transpose(biases, (0, 2, 1, 3)).reshape(layers, 1, -1)}
    glu = moe.clamped_swiglu(1.0, 1.702)
    x = rng.normal(0, 1, (6, d)).astype(np.float32)

    def block(layers_, i, h):
        with reading_in_place():
            return moe.moe_mlp(layer_view(layers_, i), h, k, glu)
    args = (jax.tree.map(jnp.asarray, stacked), jnp.int32(2), jnp.asarray(x))
    assert jax.jit(block).lower(*args).as_text().count(TARGET) == 1
    weights, experts = moe.route(jnp.asarray(x @ stacked["router"][2]), k)

    def clamped(g, u):
        g, u = np.minimum(g, 1.0), np.clip(u, -1.0, 1.0)
        return (u + 1) * g / (1 + np.exp(-1.702 * g))
    want = _want(x, np.asarray(weights), np.asarray(experts), gate[2], up[2], down[2],
                 clamped, b_gate[2], b_up[2])
    np.testing.assert_allclose(np.asarray(jax.jit(block)(*args)), want, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_a_cpu_step_takes_the_kernel_at_every_size_quantized_experts_too(tokens, quantization):
    """The block on a CPU calls the kernel once at any token count, on float experts and on
    experts quantized as the loaders store them (int8 or fp8 values, a scale per expert and
    output column), which equal the reference on their dequantized weights (70 tokens: the
    packed register tiles, 1 and 3: the streamed rows)."""
    from jserve.model import quant

    e, k, d, f = 8, 2, 32, 48
    gate, up, down = _case(1, e, d, f)
    gate_up, down_s = _stacks(gate, up, down)
    rng = np.random.default_rng(tokens)
    layer = {"router": jnp.asarray(rng.normal(0, 1, (d, e)), jnp.float32),
             "we_gate_up": jnp.asarray(gate_up[0]), "we_down": jnp.asarray(down_s[0])}
    x = jnp.asarray(rng.normal(0, 1, (tokens, d)), jnp.float32)
    block = jax.jit(lambda l, h: moe.moe_mlp(l, h, k))
    assert block.lower(layer, x).as_text().count(TARGET) == 1
    quantized = {n: quant.quantize_weight(w, quantization) if n.startswith("we_") else w
                 for n, w in layer.items()}
    assert moe.native(quantized, moe.silu_glu)
    assert block.lower(quantized, x).as_text().count(TARGET) == 1
    values = {n: np.asarray(w.qvalue.astype(jnp.float32) * w.scale)
              for n, w in quantized.items() if n.startswith("we_")}
    g, u = np.split(values["we_gate_up"].reshape(d, e, 2 * f), 2, axis=-1)
    weights, experts = moe.route(x @ layer["router"], k)
    want = _want(np.asarray(x), np.asarray(weights), np.asarray(experts),
                 g.transpose(1, 0, 2), u.transpose(1, 0, 2), values["we_down"])
    np.testing.assert_allclose(np.asarray(block(quantized, x)), want, atol=3e-5, rtol=1e-5)

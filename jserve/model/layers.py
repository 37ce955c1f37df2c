"""The pieces a family's decoder layer is built from (pure JAX): RMSNorm (Llama's and Gemma's
1 + w kind), RoPE (one table, or a second for Gemma 3's local layers picked per layer), the
q/k/v projections, the gated MLP, and the pre-norm block Llama, Qwen2 and Qwen3 share.

A layer is a function ``(layer, x, cos, sin, attend, *, cfg, tp_axis) -> (x, aux)`` over one
layer's params dict (``jserve.model.families``: each family names its layer). Optional parts
are switched by the params a layer has, not by flags: q/k/v biases where ``bq``/``bk``/``bv``
are present (Qwen2), per-head q/k RMSNorm where ``q_norm``/``k_norm`` are (Qwen3), the
mixture-of-experts block in place of the MLP where a ``router`` is (Mixtral). Head
counts come from the weights' shapes, so under ``shard_map`` the same code runs a
tensor-parallel shard's heads and MLP slice.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jserve.config import ModelConfig, inv_frequencies, rope_attention_factor
from jserve.model.lora import added
from jserve.model.moe import clamped_swiglu, moe_mlp, silu_glu
from jserve.model.quant import matmul
from jserve.model.tp_layout import part_widths

# One layer's params (a dict of arrays); not ``jserve.model.params.Params``, whose module
# reads the families' shapes, which name the layers here.
Layer = dict[str, Any]


def project(layer: Layer, name: str, h: jax.Array) -> jax.Array:
    """``h @ layer[name]``, plus each token's LoRA delta where the step has adapters
    (``jserve.model.lora``): every projection a family's layer makes goes through here."""
    return added(layer, name, h, matmul(h, layer[name]))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm (and Qwen2's, Qwen3's): normalise in float32, cast back, then
    scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """HF Gemma3RMSNorm: the weight is an offset from 1 (scale by 1 + w), applied in float32
    before the cast back (Llama's casts first, then scales)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [..., D] of RoPE at ``positions`` [...]; with ``cfg.rope_local_theta``
    (Gemma 3) both tables stacked [2, ..., D], the local layers' second, computed once per
    step for every layer (``layer_rope`` picks a layer's)."""
    invs = [inv_frequencies(cfg)]
    if cfg.rope_local_theta is not None:
        invs.append(inv_frequencies(dataclasses.replace(
            cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(np.stack(invs))[
        (slice(None),) + (None,) * positions.ndim]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    factor = rope_attention_factor(cfg)  # YaRN's, on the global table; as HF, after cos/sin
    if factor != 1.0:
        scale = jnp.asarray([factor] + [1.0] * (len(invs) - 1), jnp.float32)[
            (slice(None),) + (None,) * (emb.ndim - 1)]
        cos, sin = cos * scale, sin * scale
    if len(invs) == 1:
        cos, sin = cos[0], sin[0]
    return cos, sin


def rope_kinds(cfg: ModelConfig) -> tuple[int, ...]:
    """Each layer's row of the stacked ``rope_tables``: 1 (local) for a windowed layer when
    the config has a local RoPE base, else 0."""
    if cfg.rope_local_theta is None:
        return (0,) * cfg.num_hidden_layers
    return tuple(int(w > 0) for w in cfg.layer_windows or (0,) * cfg.num_hidden_layers)


def layer_rope(cos: jax.Array, sin: jax.Array, cfg: ModelConfig, i
               ) -> tuple[jax.Array, jax.Array]:
    """The RoPE tables of layer ``i`` (its index in the whole model: an int, or traced in a
    layer loop or a pipeline stage) from ``rope_tables``: as they are with one RoPE (no work
    added), else that layer's row (static for an int ``i``)."""
    if cfg.rope_local_theta is None:
        return cos, sin
    kinds = rope_kinds(cfg)
    if isinstance(i, int):
        return cos[kinds[i]], sin[kinds[i]]
    k = jnp.asarray(kinds, jnp.int32)[i]
    pick = lambda t: jax.lax.dynamic_index_in_dim(t, k, keepdims=False)
    return pick(cos), pick(sin)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x [..., T, H, D]; cos/sin [..., T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin


def qkv_heads(layer: Layer, h: jax.Array, cfg: ModelConfig, tp_axis: str | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The query, key and value heads [..., H, head_dim] of ``h``: one matmul of the fused
    ``wqkv`` (on a tp shard over ``tp_axis`` its own heads' columns, ``tp_layout``) or
    three of the checkpoint's ``wq``, ``wk``, ``wv``; plus ``bq``, ``bk``, ``bv`` where the
    layer has them (norms and RoPE are the caller's)."""
    if "wqkv" in layer:
        tp = 1 if tp_axis is None else jax.lax.axis_size(tp_axis)
        widths = [w // tp for w in part_widths("wqkv", cfg, tp)]
        parts = jnp.split(project(layer, "wqkv", h), np.cumsum(widths)[:-1].tolist(), axis=-1)
    else:
        parts = [project(layer, w, h) for w in ("wq", "wk", "wv")]
    heads = []
    for y, bias in zip(parts, ("bq", "bk", "bv")):
        if bias in layer:
            y = y + layer[bias]
        heads.append(y.reshape(*h.shape[:-1], -1, cfg.head_dim))
    return tuple(heads)


def gated_mlp(layer: Layer, h: jax.Array, act: Callable = jax.nn.silu) -> jax.Array:
    """``act(h @ w_gate) * (h @ w_up) @ w_down`` of either layout: the runtime one (fused
    ``w_gate_up``) or the checkpoint's (``w_gate`` and ``w_up``); a tp shard's partial
    output (the caller sums it over tp)."""
    if "w_gate_up" in layer:
        gate, up = jnp.split(project(layer, "w_gate_up", h), 2, axis=-1)
    else:
        gate, up = project(layer, "w_gate", h), project(layer, "w_up", h)
    return project(layer, "w_down", act(gate) * up)


def moe_block(layer: Layer, h: jax.Array, cfg: ModelConfig, tp_axis: str | None = None
              ) -> jax.Array:
    """The MoE MLP (``jserve.model.moe``): the routed experts (gpt-oss's clamped SwiGLU
    where the config sets ``swiglu_limit``), plus a shared expert where the layer has one
    (Qwen2-MoE: a gated MLP on every token, scaled per token by sigmoid(h @
    ``shared_gate``); a per-token scalar, so a tp shard's partial sum stays one)."""
    glu = (silu_glu if cfg.swiglu_limit is None
           else clamped_swiglu(cfg.swiglu_limit, cfg.swiglu_alpha))
    out = moe_mlp(layer, h, cfg.num_experts_per_tok, glu, cfg.norm_topk_prob, tp_axis)
    if "ws_down" not in layer:
        return out
    shared = gated_mlp({"w" + name[2:]: w for name, w in layer.items()
                        if name.startswith("ws_")}, h)
    gate = jax.nn.sigmoid(h @ layer["shared_gate"].astype(h.dtype))
    return out + gate * shared


def tp_sum(tp_axis: str | None) -> Callable[[jax.Array], jax.Array]:
    """Sums a tp shard's partial output over ``tp_axis`` (Megatron); the identity without."""
    return (lambda y: jax.lax.psum(y, tp_axis)) if tp_axis else (lambda y: y)


def pre_norm_layer(layer: Layer, x: jax.Array, cos: jax.Array, sin: jax.Array,
                   attend: Callable, *, cfg: ModelConfig, tp_axis: str | None = None
                   ) -> tuple[jax.Array, Any]:
    """One Llama-style block on the residual stream ``x`` [..., hidden] (token-flattened
    [T, hidden] when serving, [B, T, hidden] in training): RMSNorm, attention, residual;
    RMSNorm, gated SiLU MLP (or the MoE block), residual.

    ``attend(q, k, v)`` is the attention core, q [..., Hq, D] and k, v [..., Hkv, D] with RoPE
    applied -> (out [..., Hq, D], aux): the serving step's paged attention
    (``jserve.model.decoder.step_layer``, aux the updated KV pages) or the trainer's dense
    masked attention. Returns (residual stream, aux). ``tp_axis`` names the mesh axis whose
    partial attention and MLP outputs are summed."""
    lead = x.shape[:-1]
    reduce = tp_sum(tp_axis)
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q, k, v = qkv_heads(layer, h, cfg, tp_axis)
    norm = lambda y, name: rms_norm(y, layer[name], cfg.rms_norm_eps) if name in layer else y
    q = apply_rope(norm(q, "q_norm"), cos, sin)  # per head, before RoPE (Qwen3)
    k = apply_rope(norm(k, "k_norm"), cos, sin)
    out, aux = attend(q, k, v)
    x = x + reduce(project(layer, "wo", out.reshape(*lead, -1).astype(x.dtype)))
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    mlp = moe_block(layer, h, cfg, tp_axis) if "router" in layer else gated_mlp(layer, h)
    return x + reduce(mlp), aux

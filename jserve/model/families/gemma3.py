"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``: the 270M and 1B models).

Beyond Llama's block: every RMSNorm scales by 1 + w in float32 (``gemma_rms_norm``; the final
norm too, ``Family.norm``), four per layer (before and after the attention and the MLP: the
leaves ``attn_norm``, ``attn_out_norm``, ``mlp_norm``, ``mlp_out_norm``), per-head q/k norms
of the same kind, a GeGLU MLP (tanh-approximated GELU), attention scores scaled by
``query_pre_attn_scalar ** -0.5`` (q is scaled before the kernels, which scale by
``head_dim ** -0.5``), the embedding multiplied by sqrt(hidden) and tied to the LM head,
logits capped by ``final_logit_softcapping`` (``decoder.head_logits``). Layers interleave
sliding-window ("sliding_attention") and global ("full_attention") attention
(``layer_types``, or every ``sliding_window_pattern``-th layer global in older configs),
recorded as ``ModelConfig.layer_windows``; the two kinds have their own RoPE (local: base
``rope_local_base_freq``, unscaled; global: ``rope_theta`` with its linear scaling), in
transformers 5's ``rope_parameters`` per layer type or the older flat keys.

Gemma 2's ``attn_logit_softcapping`` (a cap on attention scores, which the kernels do not
apply) and the bidirectional variant are refused.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jserve.config import ModelConfig, RopeScaling
from jserve.model.families import llama
from jserve.model.families.base import Family, Tensor, refuse_flags
from jserve.model.layers import (
    Layer,
    apply_rope,
    gated_mlp,
    gemma_rms_norm,
    project,
    qkv_heads,
    tp_sum,
)

# Gemma3TextConfig's defaults where they differ from what every family reads alike.
_DEFAULTS = dict(rms_norm_eps=1e-6, head_dim=256, num_key_value_heads=4,
                 tie_word_embeddings=True, max_position_embeddings=131072, bos_token_id=2,
                 eos_token_id=1, query_pre_attn_scalar=256, sliding_window=4096,
                 sliding_window_pattern=6, rope_theta=1_000_000.0,
                 rope_local_base_freq=10_000.0)
_KINDS = ("sliding_attention", "full_attention")


def _rope(params: dict[str, Any], what: str) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of one layer type's RoPE parameters: default or linear."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "linear" and what == "full_attention":
        return float(params["rope_theta"]), RopeScaling(float(params["factor"]),
                                                        rope_type="linear")
    if kind != "default":
        raise ValueError(f"unsupported RoPE type {kind!r} for Gemma 3's {what} layers "
                         "(supported: default, and linear on the global layers)")
    return float(params["rope_theta"]), None


def _ropes(hf: dict[str, Any]) -> dict[str, tuple[float, RopeScaling | None]]:
    """Each layer type's RoPE: transformers 5's ``rope_parameters`` keyed by layer type, or
    the older ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq``."""
    per_type = hf.get("rope_parameters")
    if isinstance(per_type, dict) and "full_attention" in per_type:
        local = per_type.get("sliding_attention") or {}
        local = {"rope_theta": _DEFAULTS["rope_local_base_freq"], **local}
        full = {"rope_theta": _DEFAULTS["rope_theta"], **per_type["full_attention"]}
    else:
        full = {**(hf.get("rope_scaling") or {}),
                "rope_theta": hf.get("rope_theta", _DEFAULTS["rope_theta"])}
        local = {"rope_theta": hf.get("rope_local_base_freq",
                                      _DEFAULTS["rope_local_base_freq"])}
    return {kind: _rope(p, kind) for kind, p in (("full_attention", full),
                                                 ("sliding_attention", local))}


def _layer_windows(hf: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's window (0: global) from ``layer_types``, else HF's rule for the older
    ``sliding_window_pattern`` (layer i is global when (i + 1) % pattern == 0)."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", _DEFAULTS["sliding_window_pattern"])
        types = [_KINDS[(i + 1) % pattern == 0] for i in range(n)]
    if len(types) != n or set(types) - set(_KINDS):
        raise ValueError(f"layer_types must give one of {_KINDS} for each of the {n} layers, "
                         f"got {types}")
    window = hf.get("sliding_window", _DEFAULTS["sliding_window"])
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"config.json sets attn_logit_softcapping={hf['attn_logit_softcapping']} (a tanh "
            "cap on the attention scores, Gemma 2 style), which jserve's attention kernels do "
            "not apply; Gemma 3 configs leave it null")
    refuse_flags(hf, "attention_bias", "use_bidirectional_attention")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r} (Gemma 3 uses "
                         "'gelu_pytorch_tanh')")
    d = {**_DEFAULTS, **hf}
    ropes = _ropes(hf)
    eos = d["eos_token_id"]
    cap = hf.get("final_logit_softcapping")
    return dict(
        rms_norm_eps=float(d["rms_norm_eps"]), head_dim=int(d["head_dim"]),
        num_key_value_heads=int(d["num_key_value_heads"]),
        tie_word_embeddings=bool(d["tie_word_embeddings"]),
        max_position_embeddings=int(d["max_position_embeddings"]),
        bos_token_id=d["bos_token_id"],
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        hidden_act=act, layer_windows=_layer_windows(hf),
        rope_theta=ropes["full_attention"][0], rope_scaling=ropes["full_attention"][1],
        rope_local_theta=ropes["sliding_attention"][0],
        query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
        final_logit_softcapping=None if cap is None else float(cap))


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Llama's projections and MLP, four norms (Llama's ``mlp_norm`` is the norm before the
    MLP, here ``pre_feedforward_layernorm``) and the q/k norms."""
    d = cfg.hidden_size
    return {**llama.layer_tensors(cfg),
            "attn_out_norm": Tensor("post_attention_layernorm.weight", (d,)),
            "mlp_norm": Tensor("pre_feedforward_layernorm.weight", (d,)),
            "mlp_out_norm": Tensor("post_feedforward_layernorm.weight", (d,)),
            "q_norm": Tensor("self_attn.q_norm.weight", (cfg.head_dim,)),
            "k_norm": Tensor("self_attn.k_norm.weight", (cfg.head_dim,))}


_GELU_TANH = functools.partial(jax.nn.gelu, approximate=True)  # HF's gelu_pytorch_tanh


def decoder_layer(layer: Layer, x: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: Callable, *, cfg: ModelConfig, tp_axis: str | None = None
                  ) -> tuple[jax.Array, Any]:
    """Gemma 3's block (``jserve.model.layers.pre_norm_layer`` says what the arguments are):
    norm, attention, norm, residual; norm, GeGLU MLP, norm, residual. The output norms run
    on the tp-summed outputs."""
    lead = x.shape[:-1]
    reduce = tp_sum(tp_axis)
    norm = lambda y, name: gemma_rms_norm(y, layer[name], cfg.rms_norm_eps)  # noqa: E731
    h = norm(x, "attn_norm")
    q, k, v = qkv_heads(layer, h, cfg, tp_axis)
    q = apply_rope(norm(q, "q_norm"), cos, sin)
    k = apply_rope(norm(k, "k_norm"), cos, sin)
    # Scores are scaled by query_pre_attn_scalar ** -0.5; the kernels scale by head_dim ** -0.5.
    factor = (cfg.head_dim / (cfg.query_pre_attn_scalar or cfg.head_dim)) ** 0.5
    if factor != 1.0:
        q = q * jnp.asarray(factor, q.dtype)
    out, aux = attend(q, k, v)
    x = x + norm(reduce(project(layer, "wo", out.reshape(*lead, -1).astype(x.dtype))),
                 "attn_out_norm")
    return x + norm(reduce(gated_mlp(layer, norm(x, "mlp_norm"), _GELU_TANH)),
                    "mlp_out_norm"), aux


FAMILY = Family(name="gemma3", architectures=("Gemma3ForCausalLM",),
                model_type="gemma3_text", read_config=read_config,
                layer_tensors=layer_tensors, decoder_layer=decoder_layer,
                norm=gemma_rms_norm, scaled_embedding=True)

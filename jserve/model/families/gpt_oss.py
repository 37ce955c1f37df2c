"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b and -120b): a pre-norm MoE decoder whose
attention has biases on all four projections and a learned sink logit per query head
(``jserve.kernels.blocks.with_sinks``), layers alternating between sliding-window and full
attention (``layer_types``; window ``sliding_window``), YaRN RoPE; every layer's MLP a
mixture of ``num_local_experts`` experts, the router (with a bias) picking
``num_experts_per_tok`` whose weights are the softmax over the chosen logits (the top-k of
the full softmax renormalised), each expert a clamped SwiGLU with biases
(``jserve.model.moe.clamped_swiglu``). Its RMSNorm scales in float32 before the cast back.

The checkpoint stores each layer's experts as stacks: ``gate_up_proj`` [E, hidden, 2 *
inter] with the gate and up columns interleaved (read as two views, ``checkpoint_files``),
``down_proj`` [E, inter, hidden] and their biases. The released checkpoints store those
stacks in MXFP4 (``quantization_config``), decoded to float at load
(``checkpoint_files.decode_mxfp4``).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jserve.config import ModelConfig
from jserve.model.families import qwen2
from jserve.model.families.base import MLP_LEAVES, Family, Tensor
from jserve.model.layers import Layer, apply_rope, moe_block, project, qkv_heads, tp_sum

_KINDS = ("sliding_attention", "full_attention")


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("attention_bias", True) is not True:
        raise ValueError("config.json sets attention_bias=false, which jserve does not "
                         "support for gpt-oss (its attention always has biases here)")
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types") or [_KINDS[i % 2] for i in range(n)]
    if len(kinds) != n or set(kinds) - set(_KINDS):
        raise ValueError(f"layer_types must give one of {_KINDS} for each of the {n} "
                         f"layers, got {kinds}")
    window = hf.get("sliding_window", 128)
    if "sliding_attention" in kinds and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    return {"layer_windows": tuple(window if k == "sliding_attention" else 0 for k in kinds),
            "num_experts": hf["num_local_experts"],
            "num_experts_per_tok": hf["num_experts_per_tok"],
            "norm_topk_prob": True,  # a softmax over the chosen logits
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702))}


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Qwen2's attention tensors (Llama's with q/k/v biases) plus the o-projection's bias
    and the sinks; the router with its bias; the experts' stacks as the checkpoint holds
    them, gate and up as views of the interleaved ``gate_up_proj`` (their biases as
    one-row matrices)."""
    d, f, e = cfg.hidden_size, cfg.expert_size, cfg.num_experts
    attention = {k: t for k, t in qwen2.layer_tensors(cfg).items() if k not in MLP_LEAVES}
    stacks = "mlp.experts."
    return {**attention,
            "bo": Tensor("self_attn.o_proj.bias", (d,)),
            "sinks": Tensor("self_attn.sinks", (cfg.num_attention_heads,)),
            "router": Tensor("mlp.router.weight", (d, e), True),
            "router_bias": Tensor("mlp.router.bias", (e,)),
            "we_gate": Tensor(stacks + "gate_up_proj[{e}, :, 0::2]", (e, d, f), experts=True),
            "we_up": Tensor(stacks + "gate_up_proj[{e}, :, 1::2]", (e, d, f), experts=True),
            "be_gate": Tensor(stacks + "gate_up_proj_bias[{e}, None, 0::2]", (e, 1, f),
                              experts=True),
            "be_up": Tensor(stacks + "gate_up_proj_bias[{e}, None, 1::2]", (e, 1, f),
                            experts=True),
            "we_down": Tensor(stacks + "down_proj", (e, f, d)),
            "be_down": Tensor(stacks + "down_proj_bias", (e, d))}


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """GptOssRMSNorm: normalise and scale in float32, then cast back (Llama's casts
    first)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


def decoder_layer(layer: Layer, x: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: Callable, *, cfg: ModelConfig, tp_axis: str | None = None
                  ) -> tuple[jax.Array, Any]:
    """gpt-oss's block (``jserve.model.layers.pre_norm_layer`` says what the arguments
    are): norm, attention with sinks, the o-projection and its bias (added once, after the
    tp sum), residual; norm, the MoE block, residual."""
    lead = x.shape[:-1]
    reduce = tp_sum(tp_axis)
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q, k, v = qkv_heads(layer, h, cfg, tp_axis)
    out, aux = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v,
                      sinks=layer["sinks"])
    attn = reduce(project(layer, "wo", out.reshape(*lead, -1).astype(x.dtype))) + layer["bo"]
    x = x + attn
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    return x + reduce(moe_block(layer, h, cfg, tp_axis)), aux


FAMILY = Family(name="gpt_oss", architectures=("GptOssForCausalLM",), model_type="gpt_oss",
                read_config=read_config, layer_tensors=layer_tensors,
                decoder_layer=decoder_layer, norm=rms_norm)

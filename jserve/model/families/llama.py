"""Llama (``LlamaForCausalLM``: Llama 2, 3, 3.1, 3.2): the pre-norm block with a gated SiLU
MLP, RoPE with Llama 3.1 scaling (``jserve.config.hf_config_fields``), no biases. Its layer
tensors are the base the Qwen families extend."""
from __future__ import annotations

from typing import Any

from jserve.config import ModelConfig
from jserve.model.families.base import Family, Tensor, refuse_flags, require_act
from jserve.model.layers import pre_norm_layer


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_flags(hf, "attention_bias", "mlp_bias")
    require_act(hf, "silu")
    return {}


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Pre-attention and pre-MLP RMSNorms, q/k/v/o projections, the gated MLP."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {"attn_norm": Tensor("input_layernorm.weight", (d,)),
            "wq": Tensor("self_attn.q_proj.weight", (d, q), True),
            "wk": Tensor("self_attn.k_proj.weight", (d, kv), True),
            "wv": Tensor("self_attn.v_proj.weight", (d, kv), True),
            "wo": Tensor("self_attn.o_proj.weight", (q, d), True),
            "mlp_norm": Tensor("post_attention_layernorm.weight", (d,)),
            "w_gate": Tensor("mlp.gate_proj.weight", (d, f), True),
            "w_up": Tensor("mlp.up_proj.weight", (d, f), True),
            "w_down": Tensor("mlp.down_proj.weight", (f, d), True)}


FAMILY = Family(name="llama", architectures=("LlamaForCausalLM",), model_type="llama",
                read_config=read_config, layer_tensors=layer_tensors,
                decoder_layer=pre_norm_layer)

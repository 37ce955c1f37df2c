"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): Llama's block with biases on the q, k and v
projections (not on o); embeddings tied or not per config (the small Qwen2.5 models tie
them), RoPE theta from the config. The config's ``sliding_window`` is used only with
``use_sliding_window``, on the layers from ``max_window_layers`` on (or those ``layer_types``
names): ``base.qwen_layer_windows``."""
from __future__ import annotations

from typing import Any

from jserve.config import ModelConfig
from jserve.model.families import llama
from jserve.model.families.base import Family, Tensor, qwen_layer_windows, require_act
from jserve.model.layers import pre_norm_layer


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    require_act(hf, "silu")
    return {"layer_windows": qwen_layer_windows(hf)}


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Llama's, plus the q/k/v biases (the layer adds them where present)."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return {**llama.layer_tensors(cfg),
            "bq": Tensor("self_attn.q_proj.bias", (q,)),
            "bk": Tensor("self_attn.k_proj.bias", (kv,)),
            "bv": Tensor("self_attn.v_proj.bias", (kv,))}


FAMILY = Family(name="qwen2", architectures=("Qwen2ForCausalLM",), model_type="qwen2",
                read_config=read_config, layer_tensors=layer_tensors,
                decoder_layer=pre_norm_layer)

"""Qwen3 (dense, ``Qwen3ForCausalLM``): Llama's block with an RMSNorm over each query and
key head (``q_norm``/``k_norm`` [head_dim], before RoPE) and no biases; ``head_dim`` comes
from the config and need not be hidden / heads. Sliding windows as Qwen2's
(``base.qwen_layer_windows``)."""
from __future__ import annotations

from typing import Any

from jserve.config import ModelConfig
from jserve.model.families import llama
from jserve.model.families.base import (
    Family,
    Tensor,
    qwen_layer_windows,
    refuse_flags,
    require_act,
)
from jserve.model.layers import pre_norm_layer


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_flags(hf, "attention_bias")
    require_act(hf, "silu")
    return {"layer_windows": qwen_layer_windows(hf)}


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Llama's, plus the per-head q/k norms (the layer applies them where present)."""
    return {**llama.layer_tensors(cfg),
            "q_norm": Tensor("self_attn.q_norm.weight", (cfg.head_dim,)),
            "k_norm": Tensor("self_attn.k_norm.weight", (cfg.head_dim,))}


FAMILY = Family(name="qwen3", architectures=("Qwen3ForCausalLM",), model_type="qwen3",
                read_config=read_config, layer_tensors=layer_tensors,
                decoder_layer=pre_norm_layer)

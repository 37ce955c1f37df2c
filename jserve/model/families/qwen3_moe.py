"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B):
Qwen3's attention (per-head q/k norms, no biases) with a mixture-of-experts MLP in every
layer: a softmax router over ``num_experts`` experts ``moe_intermediate_size`` wide, the top
``num_experts_per_tok`` renormalised with ``norm_topk_prob`` (the released models set it),
no shared expert. A config with dense layers (``decoder_sparse_step`` > 1,
``mlp_only_layers``) is refused by name (``base.qwen_moe_fields``)."""
from __future__ import annotations

from typing import Any

from jserve.config import ModelConfig
from jserve.model.families import qwen3
from jserve.model.families.base import MLP_LEAVES, Family, Tensor, moe_tensors, qwen_moe_fields
from jserve.model.layers import pre_norm_layer


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    return {**qwen3.read_config(hf), **qwen_moe_fields(hf)}


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Qwen3's attention; the router and the experts in place of the MLP."""
    attention = {k: t for k, t in qwen3.layer_tensors(cfg).items() if k not in MLP_LEAVES}
    return {**attention, **moe_tensors(cfg, "mlp.", "gate_proj", "up_proj", "down_proj")}


FAMILY = Family(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",),
                model_type="qwen3_moe", read_config=read_config,
                layer_tensors=layer_tensors, decoder_layer=pre_norm_layer)

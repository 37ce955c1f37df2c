"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases, its sliding-window rule) with a mixture-of-experts MLP in every layer: a softmax
router over ``num_experts`` experts ``moe_intermediate_size`` wide, the top
``num_experts_per_tok`` renormalised only with ``norm_topk_prob`` (off by default), plus a
shared expert ``shared_expert_intermediate_size`` wide on every token, scaled per token by
sigmoid(``shared_expert_gate``) (``jserve.model.layers.moe_block``). A config with dense
layers (``decoder_sparse_step`` > 1, ``mlp_only_layers``) is refused by name
(``base.qwen_moe_fields``)."""
from __future__ import annotations

from typing import Any

from jserve.config import ModelConfig
from jserve.model.families import qwen2
from jserve.model.families.base import (
    MLP_LEAVES,
    Family,
    Tensor,
    moe_tensors,
    qwen_moe_fields,
)
from jserve.model.layers import pre_norm_layer


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("qkv_bias", True) is not True:
        raise ValueError("config.json sets qkv_bias=false, which jserve does not support "
                         "for Qwen2-MoE (its attention always has q/k/v biases here)")
    return {**qwen2.read_config(hf), **qwen_moe_fields(hf),
            "shared_expert_size": hf["shared_expert_intermediate_size"]}


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Qwen2's attention; the router, the experts and the shared expert with its gate."""
    d, s = cfg.hidden_size, cfg.shared_expert_size
    attention = {k: t for k, t in qwen2.layer_tensors(cfg).items() if k not in MLP_LEAVES}
    return {**attention, **moe_tensors(cfg, "mlp.", "gate_proj", "up_proj", "down_proj"),
            "ws_gate": Tensor("mlp.shared_expert.gate_proj.weight", (d, s), True),
            "ws_up": Tensor("mlp.shared_expert.up_proj.weight", (d, s), True),
            "ws_down": Tensor("mlp.shared_expert.down_proj.weight", (s, d), True),
            "shared_gate": Tensor("mlp.shared_expert_gate.weight", (d, 1), True)}


FAMILY = Family(name="qwen2_moe", architectures=("Qwen2MoeForCausalLM",),
                model_type="qwen2_moe", read_config=read_config,
                layer_tensors=layer_tensors, decoder_layer=pre_norm_layer)

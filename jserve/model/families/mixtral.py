"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a mixture-of-experts MLP in
every layer (``jserve.model.moe``): ``num_local_experts`` gated SiLU experts, of which the
router picks ``num_experts_per_tok`` per token with renormalised softmax weights. The
checkpoint stores each expert's w1 (gate), w3 (up) and w2 (down) on its own; they are
stacked at load. ``sliding_window`` null or absent (MixtralConfig's default) means full
attention."""
from __future__ import annotations

from typing import Any

from jserve.config import ModelConfig
from jserve.model.families import llama
from jserve.model.families.base import (
    MLP_LEAVES,
    Family,
    Tensor,
    moe_tensors,
    refuse_flags,
    require_act,
)
from jserve.model.layers import pre_norm_layer


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_flags(hf, "attention_bias", "mlp_bias")
    require_act(hf, "silu")
    fields = {"num_experts": hf["num_local_experts"],
              "num_experts_per_tok": hf["num_experts_per_tok"]}
    window = hf.get("sliding_window")
    if window is None:
        return fields
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    return {**fields, "layer_windows": (window,) * hf["num_hidden_layers"]}


def layer_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
    """Llama's norms and attention; the router and the experts in place of the MLP."""
    attention = {k: t for k, t in llama.layer_tensors(cfg).items() if k not in MLP_LEAVES}
    return {**attention, **moe_tensors(cfg, "block_sparse_moe.", "w1", "w3", "w2")}


FAMILY = Family(name="mixtral", architectures=("MixtralForCausalLM",), model_type="mixtral",
                read_config=read_config, layer_tensors=layer_tensors,
                decoder_layer=pre_norm_layer)

"""Mistral (``MistralForCausalLM``): Llama's block (no biases, gated SiLU MLP) with
sliding-window attention on every layer: a query at position p reads the keys at
p - sliding_window < k <= p (``ModelConfig.layer_windows``; the kernels skip the pages before
the window). ``sliding_window`` null means full attention (Mistral 7B v0.2 on); a config
without the key gets transformers' default, 4096. ``head_dim`` comes from the config where it
is given (Mistral Nemo's 128 beside hidden / heads = 160). ``layer_types`` is not Mistral's
(transformers ignores it for this class: every layer uses ``sliding_window``)."""
from __future__ import annotations

from typing import Any

from jserve.model.families import llama
from jserve.model.families.base import Family, refuse_flags, require_act
from jserve.model.layers import pre_norm_layer

DEFAULT_WINDOW = 4096  # MistralConfig's when config.json has no sliding_window


def read_config(hf: dict[str, Any]) -> dict[str, Any]:
    refuse_flags(hf, "attention_bias", "mlp_bias")
    require_act(hf, "silu")
    window = hf.get("sliding_window", DEFAULT_WINDOW)
    if window is None:
        return {}
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    return {"layer_windows": (window,) * hf["num_hidden_layers"]}


FAMILY = Family(name="mistral", architectures=("MistralForCausalLM",), model_type="mistral",
                read_config=read_config, layer_tensors=llama.layer_tensors,
                decoder_layer=pre_norm_layer)

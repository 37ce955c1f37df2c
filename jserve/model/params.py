"""The params pytree's type and shapes (the layout :mod:`jserve.model` describes): the
checkpoint layout (``param_shapes``: HF-shaped, one dict per layer) and the runtime layout
the step takes (``runtime_param_shapes``: the layers stacked, gate and up fused). Plain
Python: the loaders (``weights``), the model (``llama``) and the memory planner read it."""
from __future__ import annotations

from typing import Any

from jserve.config import LlamaConfig

Params = dict[str, Any]


def param_shapes(cfg: LlamaConfig) -> Params:
    """The params pytree with shape tuples as leaves: the single source of the layout."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    layer = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
             "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    shapes: Params = {"embed": (v, d),
                      "layers": [dict(layer) for _ in range(cfg.num_hidden_layers)],
                      "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def runtime_param_shapes(cfg: LlamaConfig) -> dict:
    """Shape tuples of the runtime layout (what ``llama.prepare_params`` returns): the
    checkpoint layout's per-layer shapes stacked, gate and up fused."""
    shapes = param_shapes(cfg)
    layer = dict(shapes["layers"][0])
    d, f = layer.pop("w_gate")
    layer.pop("w_up")
    layer["w_gate_up"] = (d, 2 * f)
    n = cfg.num_hidden_layers
    return {**shapes, "layers": {name: (n, *shape) for name, shape in layer.items()}}

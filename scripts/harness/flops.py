"""What a Llama step costs in FLOPs and bytes, counted from its config: the figures that turn
step times into model FLOPs and bandwidth utilisation (MFU, MBU) in the benchmarks."""
from __future__ import annotations

import math

import jax

from jserve.config import ModelConfig
from jserve.model.params import param_shapes


def weight_bytes_read(cfg: ModelConfig) -> float:
    """Weights a decode step reads: every layer, the final norm and the LM head (the
    embedding table only when it is the head: a lookup reads a few rows)."""
    shapes = param_shapes(cfg)
    n = sum(math.prod(s) for s in jax.tree.leaves(shapes["layers"],
                                                  is_leaf=lambda x: isinstance(x, tuple)))
    n += cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    return float(n * cfg.np_dtype.itemsize)


def matmul_params_per_token(cfg: ModelConfig) -> int:
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return cfg.num_hidden_layers * (2 * d * q + 2 * d * kv + 3 * d * f)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
            * cfg.np_dtype.itemsize)


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """Model FLOPs of prefilling one prompt: the layers' matmuls for every token, causal
    attention (QK^T and PV) for every (query, earlier key) pair, and the LM head once (the
    sampled token)."""
    pairs = prompt_len * (prompt_len + 1) / 2
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs
    return (2.0 * matmul_params_per_token(cfg) * prompt_len + attn
            + 2.0 * cfg.hidden_size * cfg.vocab_size)


def attention_flops(cfg: ModelConfig, rows: int, context: int) -> float:
    """QK and PV of ``rows`` decodes at ``context`` keys, every layer."""
    return 4.0 * rows * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context

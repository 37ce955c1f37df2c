"""A mixture-of-experts block's routed experts on XLA:CPU as one native call
(``native/cpu_moe.cc``, built and registered with the attention kernels by
``jserve.kernels.cpu``).

XLA:CPU has no grouped matmul (its ``ragged_dot`` is a masked dot over every expert), so the
XLA ways either run every expert or gather the chosen experts' matrices. The kernel sorts the
token-expert pairs by expert and multiplies each expert's rows by its matrices where they
lie, at a run-time layer of the stacked weights: the chosen experts' FLOPs and bytes only.
It takes float32, bfloat16, int8 and float8_e4m3fn experts (the last two with their scales
per output column, applied to the products as ``jserve.model.quant`` does) and two gated
activations: SiLU's and gpt-oss's clamped SwiGLU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jserve.kernels import cpu

# the gated activations the kernel computes, by its ``act`` code
SILU, CLAMPED_SWIGLU = 0, 1


_FLOAT = (jnp.float32, jnp.bfloat16)
_QUANTIZED = (jnp.int8, jnp.float8_e4m3fn)


def supported(gate_up: jax.Array, down: jax.Array, quantized: bool = False) -> bool:
    """Whether the kernel takes these expert stacks (their values, when ``quantized``): one
    dtype of the kernel's, and the library built."""
    return (gate_up.dtype == down.dtype
            and gate_up.dtype in (_QUANTIZED if quantized else _FLOAT) and cpu.available())


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array,
                   down: jax.Array, layer, act: int, limit: float = 0.0, alpha: float = 0.0,
                   bias: jax.Array | None = None,
                   scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Each token's router-weighted sum of its experts' gated MLPs, [T, H] in x's dtype.

    x [T, H]; weights, experts [T, k] (local ids; a pair of weight 0 adds nothing and is not
    computed); gate_up [L, H, E * 2I] and down [L, E, I, H] the stacks (a plain leaf as a
    stack of one), read at ``layer``; bias [L, 1, E * 2I] the experts' gate/up biases or
    None; ``act`` SILU or CLAMPED_SWIGLU (with ``limit`` and ``alpha``); ``scales`` the
    quantized stacks' per-column scales, [L, 1, E * 2I] and [L, E, 1, H], or None."""
    if not cpu.available():  # registers the kernel with XLA
        raise RuntimeError(f"the native CPU kernels are not built: {cpu.unavailable()}")
    t, h = x.shape
    k, inter = experts.shape[1], down.shape[2]
    none = jnp.zeros((1,), jnp.float32)
    f32 = lambda a: none if a is None else a.astype(jnp.float32)  # noqa: E731
    gate_up_scale, down_scale = scales or (None, None)
    out, _ = jax.ffi.ffi_call(
        cpu.MOE_EXPERTS, (jax.ShapeDtypeStruct((t, h), jnp.float32),
                          jax.ShapeDtypeStruct((t * k, 2 * inter), jnp.float32)))(
        x.astype(jnp.float32), weights.astype(jnp.float32), experts.astype(jnp.int32),
        gate_up, down, f32(gate_up_scale), f32(down_scale), f32(bias),
        jnp.asarray(layer, jnp.int32).reshape(1), act=np.int32(act), limit=np.float32(limit),
        alpha=np.float32(alpha), has_scales=np.int32(scales is not None),
        has_bias=np.int32(bias is not None))
    return out.astype(x.dtype)

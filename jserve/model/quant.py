"""Weight-only quantization of the decoder layers' matrices (``quantization`` = int8 | fp8).

Each of wq/wk/wv (fused: wqkv), wo, w_gate/w_up (fused: w_gate_up) and w_down, and an MoE
model's expert stacks (``tp_layout.LEAVES``' matrices), is stored as a qwix ``QArray``: int8
or float8_e4m3 values [..., in, out] and one float32 scale per output channel [..., 1, out]
(absmax calibration, ``qwix.quantize`` with the output axis, and the layer and expert axes
when stacked, channelwise; ``jserve.model.moe`` applies an expert's scales itself).
Embeddings, norms (q/k norms too), biases, the MoE router and the LM head stay in the
model's dtype (the head's logits are what sampling reads; it is one matrix
of the model's ~80). Leaf names are shared by every family (jserve/model/families/base.py).

Why per output channel: its scale factors out of the dot product, so :func:`matmul`
computes ``(x @ q) * scale`` with the scale applied to the [tokens, out] result, never to
the weight. (``qwix.dot_general`` with float activations multiplies the whole weight by its
scale before the dot, a weight-sized temporary every step where XLA does not fuse it, as on
CPU; docs/quantization.md.) The stored format is qwix's, so a qwix user reads these params.

A ``QArray`` is a pytree (values, scales; the qtype static), so stacking, slicing layers,
pipeline stages, orbax and the tp layout handle it leaf by leaf; only the sharding spec
differs between its leaves (``scale_spec``: a row-split weight's scales are per output
column, replicated on tp).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jserve.config import QUANTIZATIONS
from jserve.model.layer_weights import MATRICES, LayerOf, matmul as layer_matmul

QUANTIZED_LEAVES = MATRICES  # the layer matrices are what is quantized
_QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
SCALE_DTYPE = np.dtype(np.float32)


def validate(quantization: str) -> str:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    return quantization


def qtype(quantization: str):
    return _QTYPES[validate(quantization)]


def _qwix():
    import qwix  # imported only when quantizing (it loads flax)

    return qwix


def is_quantized(w) -> bool:
    """A qwix QArray (duck-typed, so no qwix import is needed to ask)."""
    return hasattr(w, "qvalue") and hasattr(w, "scale")


def quantize_weight(w, quantization: str):
    """``w`` [..., in, out] (numpy or jax; any leading layer axes) as a QArray with one scale
    per output channel (and per layer). Quantizes on the device ``w`` is on (numpy: the
    default one)."""
    axes = tuple(i for i in range(w.ndim) if i != w.ndim - 2)
    return _qwix().quantize(jnp.asarray(w), qtype(quantization), channelwise_axes=axes,
                            scale_dtype=SCALE_DTYPE)


def quantize_host(w: np.ndarray, quantization: str):
    """:func:`quantize_weight` on the host CPU, returned as numpy (values, scales): what the
    streaming loader slices device shards from, so no full-precision copy reaches a device."""
    with jax.default_device(jax.devices("cpu")[0]):
        q = quantize_weight(w, quantization)
        return np.asarray(q.qvalue), np.asarray(q.scale)


def from_parts(values, scales, quantization: str):
    """A QArray of already quantized ``values`` and ``scales`` (arrays or ShapeDtypeStructs)."""
    return _qwix().QArray(qvalue=values, scale=scales, zero_point=None,
                          qtype=qtype(quantization))


def quantize_params(params: dict, quantization: str) -> dict:
    """Params of either layout with every layer matrix (``QUANTIZED_LEAVES``) quantized;
    ``none`` returns them as they are. Quantizes one matrix at a time."""
    if validate(quantization) == "none":
        return params

    def layer(d):
        return {k: quantize_weight(v, quantization) if k in QUANTIZED_LEAVES and not
                is_quantized(v) else v for k, v in d.items()}

    layers = params["layers"]
    layers = [layer(d) for d in layers] if isinstance(layers, list) else layer(layers)
    return {**params, "layers": layers}


def matmul(x: jax.Array, w) -> jax.Array:
    """``x @ w`` for a plain or a per-output-channel quantized ``w``: the stored values are
    converted to x's dtype (exact: int8 and e4m3 values are bf16 numbers), multiplied with
    float32 accumulation, and the scales applied to the result."""
    if isinstance(w, LayerOf):  # a layer of stacked weights, read in place
        return layer_matmul(x, w)
    if not is_quantized(w):
        return x @ w
    y = jnp.dot(x, w.qvalue.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * w.scale.reshape(w.scale.shape[-1])).astype(x.dtype)


def scale_spec(spec):
    """The PartitionSpec of a quantized leaf's scales [..., 1, out] given its values' spec:
    the same, but the size-1 input axis is never split (a row-split weight's scales are
    replicated on tp)."""
    axes = tuple(spec)
    if len(axes) >= 2:
        axes = axes[:-2] + (None,) + axes[-1:]
    return type(spec)(*axes)


def leaf_spec(leaf, spec):
    """``spec`` for a plain leaf; for a QArray a QArray of specs (values, scales)."""
    if not is_quantized(leaf):
        return spec
    return dataclasses.replace(leaf, qvalue=spec, scale=scale_spec(spec))


def abstract_weight(shape: tuple[int, ...], quantization: str, value_sharding=None,
                    scale_sharding=None):
    """ShapeDtypeStructs of a quantized weight of ``shape`` [..., in, out]."""
    scales = (*shape[:-2], 1, shape[-1])
    return from_parts(jax.ShapeDtypeStruct(shape, np.dtype(qtype(quantization)),
                                           sharding=value_sharding),
                      jax.ShapeDtypeStruct(scales, SCALE_DTYPE, sharding=scale_sharding),
                      quantization)

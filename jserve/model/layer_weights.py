"""How the layer loop reads layer ``i`` of the stacked weights: sliced out (``w[i]``, a
``dynamic-slice`` that XLA:CPU and XLA:GPU copy every layer, every step), or in place
(``EngineConfig.layer_loop`` "indexed"): each matrix stays the whole stack, wrapped with
the layer as a :class:`LayerOf`, and ``jserve.model.quant.matmul`` hands both to the
layer matmul kernel (``jserve.kernels.layer_matmul``), which reads that layer's tiles.

The choice is made while a step is traced: the step programs take it as a static argument
and trace their forward inside :func:`reading_in_place`, so every path to the layer loop
(one device, tensor and KV parallel, each pipeline stage) picks it up without another
argument on each; the flag is per thread (programs compile on a thread pool).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import jax

# The layer matrices, the MoE router and expert stacks (``tp_layout.LEAVES``) are read in
# place (a stack's chosen experts by one gather: jserve/model/moe.py; the router by the
# layer matmul kernel, which XLA:GPU ran as a materialised product of a sliced layer); other
# leaves (norms, biases) are a few vectors a layer and are sliced as before. LoRA pools
# too (jserve/model/lora.py): sliced, each was copied out of its stack a layer a step.
from jserve.model.tp_layout import ADAPTERS, EXPERTS, MATRICES

IN_PLACE = frozenset(MATRICES) | frozenset(EXPERTS) | frozenset(ADAPTERS) | {"router"}

_state = threading.local()


@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer ``layer`` (traced int32) of the stacked matrix ``stacked`` [L, in, out] (plain
    or a quantized QArray), not sliced out."""

    stacked: Any
    layer: Any


@contextlib.contextmanager
def reading_in_place(on: bool = True) -> Iterator[None]:
    """Within it (on this thread), stacked layers are read in place (:func:`layer_view`)."""
    before = getattr(_state, "on", False)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before


def in_place() -> bool:
    return getattr(_state, "on", False)


def layer_view(layers: dict, i) -> dict:
    """Layer ``i`` of stacked ``layers``: matrices and expert stacks as :class:`LayerOf`,
    the rest sliced."""
    def one(name, w):
        if name in IN_PLACE:
            return LayerOf(w, i)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), w)
    return {name: one(name, w) for name, w in layers.items()}


def matmul(x: jax.Array, w: LayerOf) -> jax.Array:
    """``x @ w.stacked[w.layer]`` by the layer matmul kernel (the backend's flavour)."""
    from jserve.kernels.layer_matmul import layer_matmul

    return layer_matmul(x, w.stacked, w.layer)

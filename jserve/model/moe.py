"""The mixture-of-experts MLP block (pure JAX): a router picks ``k`` of ``E`` experts per
token, and only the chosen experts run.

Two ways, picked by the step's static token count (:func:`gathers`): a few tokens gather
their chosen experts' matrices (a decode step reads k experts' weights, not E); more
tokens are sorted by expert and each expert's rows go through its matrices as one grouped
matmul (``jax.lax.ragged_dot``). Each pair's output is scaled by its routing weight and
summed onto its token. Under tensor parallelism every shard holds every expert's slice of
the intermediate axis (``tp_layout``: ``we_gate_up`` by columns, ``we_down`` by rows), so the
block's output is a partial sum like the dense MLP's, summed by the caller.

Leaves of one layer: ``router`` [hidden, E], ``we_gate_up`` [E, hidden, 2 * inter] (or the
checkpoint's ``we_gate`` and ``we_up``) and ``we_down`` [E, inter, hidden].
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def route(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, experts [T, k] int32) of router ``logits`` [T, E]: softmax in
    float32, the top ``k``, renormalised to sum to one (Mixtral's router; ties go to the lower
    expert index, ``lax.top_k``'s order)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), experts.astype(jnp.int32)


def _gate_up(layer: dict[str, Any], dot: Callable) -> tuple[jax.Array, jax.Array]:
    if "we_gate_up" in layer:
        return jnp.split(dot(layer["we_gate_up"]), 2, axis=-1)
    return dot(layer["we_gate"]), dot(layer["we_up"])


def gathered_experts(layer: dict[str, Any], x: jax.Array, weights: jax.Array,
                     experts: jax.Array, act: Callable) -> jax.Array:
    """Few tokens (a decode step): each token's ``k`` experts' matrices gathered and applied
    to it alone, so only the chosen experts' weights are read."""
    dot = lambda w: jnp.einsum("td,tkdf->tkf", x, w[experts])
    gate, up = _gate_up(layer, dot)
    y = jnp.einsum("tkf,tkfd->tkd", act(gate) * up, layer["we_down"][experts])
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def grouped_experts(layer: dict[str, Any], x: jax.Array, weights: jax.Array,
                    experts: jax.Array, act: Callable) -> jax.Array:
    """Many tokens (a prefill): the token-expert pairs sorted by expert and each expert's
    rows multiplied by its matrices as one grouped matmul (``lax.ragged_dot``)."""
    k, n_experts = experts.shape[-1], layer["router"].shape[-1]
    flat = experts.reshape(-1)  # [T * k] token-major
    order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert
    token = order // k
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    xs = x[token]
    gate, up = _gate_up(layer, lambda w: jax.lax.ragged_dot(xs, w, sizes))
    y = jax.lax.ragged_dot(act(gate) * up, layer["we_down"], sizes)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y)


def gathers(tokens: int, k: int, n_experts: int) -> bool:
    """Whether ``tokens`` rows take :func:`gathered_experts`: while their pairs are fewer
    than the experts, gathering reads less than any grouped matmul that touches every
    expert (XLA:CPU expands ``ragged_dot`` into a masked dot over all of them)."""
    return tokens * k < n_experts


def moe_mlp(layer: dict[str, Any], h: jax.Array, k: int, act: Callable = jax.nn.silu
            ) -> jax.Array:
    """The MoE block on ``h`` [..., hidden]: each token through its ``k`` routed experts'
    gated MLPs, weighted by the router (a tp shard's partial output)."""
    lead, d = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, d)
    weights, experts = route(x @ layer["router"].astype(x.dtype), k)
    run = (gathered_experts if gathers(x.shape[0], k, layer["router"].shape[-1])
           else grouped_experts)
    return run(layer, x, weights, experts, act).reshape(*lead, d)

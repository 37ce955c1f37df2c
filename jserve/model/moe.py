"""The mixture-of-experts MLP block (pure JAX): a router picks ``k`` of ``E`` experts per
token, and each token's output is its experts' gated MLPs weighted by the router.

Four ways, picked statically by the step's token count and the platform the program is
lowered for (:func:`moe_mlp`). On a CPU the native kernel (:func:`native_experts`,
``jserve.kernels.cpu_moe``) groups the pairs by expert and reads each chosen expert's
matrices in place, at any token count. Elsewhere (and on a CPU without a C++ compiler) a
few tokens (a decode step: fewer token-expert pairs than experts,
:func:`gathers`) gather their chosen experts' matrices, so a step reads k experts' weights,
not E. More tokens on a TPU are sorted by expert and run as one grouped matmul
(``jax.lax.ragged_dot``, which XLA:TPU compiles to its own); on a GPU every expert runs as
two plain matmuls with the unchosen experts' activations zeroed: XLA:CPU and XLA:GPU expand
``ragged_dot`` into a masked dot over every expert for every pair, k times these FLOPs
(``scripts/bench_moe.py``).

Leaves of one layer: ``router`` [hidden, E] (and gpt-oss's ``router_bias`` [E]);
``we_gate_up`` [hidden, E * 2 * inter], every expert's gate and up columns in turn
(``tp_layout``: one plain matmul reads them all), or the checkpoint's stacks ``we_gate``
and ``we_up`` [E, hidden, inter]; ``we_down`` [E, inter, hidden]; gpt-oss's expert biases,
``be_gate_up`` [1, E * 2 * inter] (laid out as ``we_gate_up``'s columns: a matrix of one
input row, fused from ``be_gate``/``be_up`` [E, 1, inter]) and ``be_down`` [E, hidden]. The
gated activation is the family's (``glu``: SiLU's, or gpt-oss's clamped SwiGLU,
:func:`clamped_swiglu`). A shared expert (Qwen2-MoE's ``ws_`` leaves and its sigmoid gate)
is a dense gated MLP the layer adds (``jserve.model.layers.moe_block``). Under tensor
parallelism every shard holds every expert's slice of the intermediate axis, so the block's
output is a partial sum like the dense MLP's, summed by the caller.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jserve.kernels import cpu_moe
from jserve.model.layer_weights import LayerOf
from jserve.model.quant import is_quantized, matmul

# The mesh axis experts are split over (``sharding.mesh.AXES``; ``tp_layout.layer_axes``):
# an ep shard holds whole experts, runs every token (replicated over ep) through the pairs
# routed to its experts, and the shards' outputs are summed over it.
EP_AXIS = "ep"


def route(logits: jax.Array, k: int, normalize: bool = True
          ) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, experts [T, k] int32) of router ``logits`` [T, E]: softmax in
    float32, the top ``k`` (ties go to the lower expert index, ``lax.top_k``'s order),
    renormalised to sum to one when ``normalize`` (Mixtral's router always; Qwen's MoE
    families by ``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated SiLU of Mixtral's and Qwen's experts."""
    return jax.nn.silu(gate) * up


@dataclasses.dataclass(frozen=True)
class clamped_swiglu:  # noqa: N801 - used as the activation function it builds
    """gpt-oss's expert activation: the gate clamped above and the up projection on both
    sides at ``limit``, then (up + 1) * gate * sigmoid(alpha * gate). Data, so the native
    CPU way knows it (and a jit keys on it)."""
    limit: float
    alpha: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def side_by_side(gate_up: jax.Array) -> jax.Array:
    """[E, in, 2 * inter] (each expert's gate and up) as the runtime ``we_gate_up``,
    [in, E * 2 * inter]."""
    return jnp.transpose(gate_up, (1, 0, 2)).reshape(gate_up.shape[1], -1)


def _gate_up(layer: dict[str, Any], kind: str = "we") -> jax.Array | None:
    """The fused gate/up leaf of either layout: the experts' matrices (``kind`` "we") or
    their biases ("be": None where the experts have none)."""
    if kind + "_gate_up" in layer:
        return layer[kind + "_gate_up"]
    if kind + "_gate" not in layer:
        return None
    return jax.tree.map(lambda g, u: side_by_side(jnp.concatenate([g, u], axis=-1)),
                        layer[kind + "_gate"], layer[kind + "_up"])  # a QArray leaf by leaf


def _stacked(w) -> tuple[Any, Any]:
    """(the stack with a leading layer axis, the layer to read) of an expert leaf: a layer
    of the stacked weights read in place (``layer_weights.LayerOf``: the indexed layer
    loop's), or a plain leaf as a stack of one (either may be quantized: a QArray)."""
    if isinstance(w, LayerOf):
        return w.stacked, w.layer
    return jax.tree.map(lambda a: a[None], w), 0


def _whole(w):
    """An expert leaf as one array, or one QArray (a layer of stacked weights sliced out)."""
    if isinstance(w, LayerOf):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, w.layer, keepdims=False),
                            w.stacked)
    return w


def _parts(w) -> tuple[jax.Array, jax.Array | None]:
    """(values, per-output-channel scales [..., 1, out] or None) of a plain or a quantized
    expert leaf (``jserve.model.quant``: one scale per expert and output column)."""
    return (w.qvalue, w.scale) if is_quantized(w) else (w, None)


def _times(spec: str, a: jax.Array, values: jax.Array, scales: jax.Array | None
           ) -> jax.Array:
    """``einsum(spec, a, values)`` of expert matrices that may be quantized (``scales``
    their per-column scales, broadcast to the product): as ``quant.matmul``, the values in
    a's dtype (exact), float32 accumulation, the scales on the product."""
    if scales is None:
        return jnp.einsum(spec, a, values)
    y = jnp.einsum(spec, a, values.astype(a.dtype), preferred_element_type=jnp.float32)
    return (y * scales).astype(a.dtype)


def _chosen_gate_up(layer: dict[str, Any], experts: jax.Array, kind: str = "we"
                    ) -> tuple[jax.Array, jax.Array | None]:
    """The gate/up matrices (or biases, ``kind`` "be": in = 1) of each pair's expert, [T,
    k, in, 2 * inter], and their scales [T, k, 2 * inter] where quantized: one gather of
    column blocks from the [layers, in, E * 2 * inter] stack (in place, it reads only those
    experts' columns). Not a gather over a reshaped [in, E, 2 * inter]: on a TPU that
    reshape changes the tiled layout, a copy of every expert a layer (0.8 GB at
    Qwen3-30B-A3B's widths)."""
    stack, i = _stacked(_gate_up(layer, kind))
    values, scales = _parts(stack)
    width = values.shape[2] // local_experts(layer)

    def pick(a):
        rows = a.shape[1]
        block = lambda e: jax.lax.dynamic_slice(a, (i, 0, e * width), (1, rows, width))[0]
        return jax.vmap(block)(experts.reshape(-1)).reshape(*experts.shape, rows, width)
    return pick(values), None if scales is None else pick(scales)[:, :, 0]


def _chosen_down(layer: dict[str, Any], experts: jax.Array
                 ) -> tuple[jax.Array, jax.Array | None]:
    """The down matrices of each pair's expert, [T, k, inter, hidden], and their scales
    [T, k, hidden] where quantized: one dynamic slice of the [layers, E, inter, hidden]
    stack a pair (``gathers`` bounds them by E). As one gather over (layer, expert),
    XLA:TPU rewrote it into slices of the whole stack (3 GB a step at Qwen3-30B-A3B's
    widths, 4 layers)."""
    stack, i = _stacked(layer["we_down"])
    values, scales = _parts(stack)

    def pick(a):
        f, d = a.shape[2:]
        one = lambda e: jax.lax.dynamic_slice(a, (i, e, 0, 0), (1, 1, f, d))[0, 0]
        return jnp.stack([one(e) for e in experts.reshape(-1)]).reshape(*experts.shape, f, d)
    return pick(values), None if scales is None else pick(scales)[:, :, 0]


def all_experts_count(layer: dict[str, Any]) -> int:
    """The experts the router chooses among (every shard's)."""
    return _stacked(layer["router"])[0].shape[-1]


def local_experts(layer: dict[str, Any]) -> int:
    """The experts this device holds: every one, or an ``ep`` shard's E / ep."""
    return _parts(_stacked(layer["we_down"])[0])[0].shape[1]


def to_local(layer: dict[str, Any], weights: jax.Array, experts: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """(weights, experts) with the global expert ids as indices into this device's experts:
    on an ``ep`` shard (fewer local experts than the router's) the pairs of other shards'
    experts get weight 0 and index 0, so they add nothing (the shards' outputs are summed
    over ep); unchanged on a device holding every expert."""
    n_local, n_experts = local_experts(layer), all_experts_count(layer)
    if n_local == n_experts:
        return weights, experts
    local = experts - jax.lax.axis_index(EP_AXIS) * n_local
    mine = (local >= 0) & (local < n_local)
    return jnp.where(mine, weights, 0), jnp.where(mine, local, 0)


def gathered_experts(layer: dict[str, Any], x: jax.Array, weights: jax.Array,
                     experts: jax.Array, glu: Callable) -> jax.Array:
    """Few tokens: each token's ``k`` experts' matrices gathered and applied to it alone."""
    # One matrix-vector product per pair, batched over (token, pair): the gathered
    # [T, k, in, 2 * inter] is read as it lies (contracting "td" against it had XLA:GPU
    # transpose the gathered matrices first).
    rows = jnp.broadcast_to(x[:, None], (*experts.shape, x.shape[-1]))
    gate_up = _times("tkd,tkdf->tkf", rows, *_chosen_gate_up(layer, experts))
    if _gate_up(layer, "be") is not None:
        gate_up = gate_up + _chosen_gate_up(layer, experts, "be")[0][:, :, 0]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    y = _times("tkf,tkfd->tkd", glu(gate, up), *_chosen_down(layer, experts))
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def all_experts(layer: dict[str, Any], x: jax.Array, weights: jax.Array,
                experts: jax.Array, glu: Callable) -> jax.Array:
    """Every expert on every token, as two plain matmuls; an unchosen expert's activations
    are zeroed before the down projection, so it adds nothing."""
    t, n_experts = x.shape[0], local_experts(layer)
    gate_up = matmul(x, _gate_up(layer))
    if _gate_up(layer, "be") is not None:
        gate_up = gate_up + _whole(_gate_up(layer, "be"))
    gate, up = jnp.split(gate_up.reshape(t, n_experts, -1), 2, axis=-1)
    # top_k's experts are distinct; on an ep shard other shards' pairs add 0 at index 0.
    picked = jnp.zeros((t, n_experts), weights.dtype).at[
        jnp.arange(t)[:, None], experts].add(weights)
    h = glu(gate, up) * picked[..., None].astype(x.dtype)
    down, i = _stacked(layer["we_down"])
    if is_quantized(down):  # a scale per expert and column: the experts' products apart
        values, scales = _parts(_whole(layer["we_down"]))
        return _times("tef,efd->ted", h, values, scales[:, 0]).sum(axis=1)
    # [E, inter, hidden] as one [E * inter, hidden]
    flat = down.reshape(down.shape[0], -1, x.shape[-1])
    return matmul(h.reshape(t, -1), LayerOf(flat, i) if isinstance(layer["we_down"], LayerOf)
                  else flat[0])


def grouped_experts(layer: dict[str, Any], x: jax.Array, weights: jax.Array,
                    experts: jax.Array, glu: Callable) -> jax.Array:
    """The token-expert pairs sorted by expert and each expert's rows multiplied by its
    matrices as one grouped matmul (``lax.ragged_dot``, on [E, in, out] stacks)."""
    k, n_experts = experts.shape[-1], local_experts(layer)
    flat = experts.reshape(-1)  # [T * k] token-major
    order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert
    token = order // k
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    pair = flat[order]  # each sorted pair's expert

    def grouped(a, stacks, scales):  # scales [E, out] per expert, or None
        if scales is None:
            return jax.lax.ragged_dot(a, stacks, sizes)
        y = jax.lax.ragged_dot(a, stacks.astype(a.dtype), sizes,
                               preferred_element_type=jnp.float32)
        return (y * scales[pair]).astype(a.dtype)

    # [in, E * 2 * inter] as [E, in, 2 * inter]
    values, scales = _parts(_whole(_gate_up(layer)))
    stacks = jnp.transpose(values.reshape(values.shape[0], n_experts, -1), (1, 0, 2))
    gate_up = grouped(x[token], stacks, None if scales is None
                      else scales.reshape(n_experts, -1))
    if _gate_up(layer, "be") is not None:  # each pair's expert's row of the biases
        gate_up = gate_up + _whole(_gate_up(layer, "be")).reshape(n_experts, -1)[pair]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    values, scales = _parts(_whole(layer["we_down"]))
    y = grouped(glu(gate, up), values, None if scales is None else scales[:, 0])
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y)


def _native_act(glu: Callable) -> tuple[int, float, float] | None:
    """The native kernel's (act, limit, alpha) for ``glu``, or None for one it lacks."""
    if glu is silu_glu:
        return cpu_moe.SILU, 0.0, 0.0
    if isinstance(glu, clamped_swiglu):
        return cpu_moe.CLAMPED_SWIGLU, glu.limit, glu.alpha
    return None


def native(layer: dict[str, Any], glu: Callable) -> bool:
    """Whether :func:`native_experts` takes this layer: its experts float32 or bfloat16, or
    int8 or fp8 with their scales (both stacks alike), an activation the kernel has, and
    the kernel built."""
    stacks = [_stacked(w)[0] for w in (_gate_up(layer), layer["we_down"])]
    quantized = {is_quantized(w) for w in stacks}
    return (len(quantized) == 1 and _native_act(glu) is not None
            and cpu_moe.supported(*(_parts(w)[0] for w in stacks), quantized=quantized.pop()))


def native_experts(layer: dict[str, Any], x: jax.Array, weights: jax.Array,
                   experts: jax.Array, glu: Callable) -> jax.Array:
    """The pairs grouped by expert in the native CPU kernel (``jserve.kernels.cpu_moe``),
    each expert's matrices read where they lie (a layer of the stacks in place): the chosen
    experts' FLOPs and bytes, at any token count."""
    (gate_up, i), (down, _) = _stacked(_gate_up(layer)), _stacked(layer["we_down"])
    (gate_up, gate_up_scale), (down, down_scale) = _parts(gate_up), _parts(down)
    bias = _gate_up(layer, "be")
    return cpu_moe.routed_experts(
        x, weights, experts, gate_up, down, i, *_native_act(glu),
        bias=None if bias is None else _stacked(bias)[0],
        scales=None if gate_up_scale is None else (gate_up_scale, down_scale))


def gathers(tokens: int, k: int, n_experts: int) -> bool:
    """Whether ``tokens`` rows take :func:`gathered_experts`: while their pairs are fewer
    than the experts, gathering reads less than any way that touches every expert."""
    return tokens * k < n_experts


def down_bias(layer: dict[str, Any], weights: jax.Array, experts: jax.Array,
              tp_axis: str | None) -> jax.Array:
    """Each token's router-weighted sum of its experts' down-projection biases
    (``be_down``), [T, hidden], on the first tp shard only (zero on the others: the caller
    sums the shards' outputs over tp, which then counts it once); local pairs only, like
    the experts' outputs."""
    rows = jnp.take(_whole(layer["be_down"]), experts, axis=0)  # [T, k, hidden]
    bias = jnp.einsum("tk,tkd->td", weights.astype(rows.dtype), rows)
    if tp_axis is None:
        return bias
    return jnp.where(jax.lax.axis_index(tp_axis) == 0, bias, jnp.zeros_like(bias))


def moe_mlp(layer: dict[str, Any], h: jax.Array, k: int, glu: Callable = silu_glu,
            normalize: bool = True, tp_axis: str | None = None) -> jax.Array:
    """The routed experts on ``h`` [..., hidden]: each token through its ``k`` routed
    experts' gated MLPs, weighted by the router (``route``; a tp shard's partial output,
    ``tp_axis`` naming the axis it is summed over, for the experts' down biases)."""
    lead, d = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, d)
    logits = matmul(x, layer["router"])
    if "router_bias" in layer:
        logits = logits + layer["router_bias"]
    weights, experts = to_local(layer, *route(logits, k, normalize))
    run = lambda way: lambda: way(layer, x, weights, experts, glu)  # closes over the
    # layer: an in-place leaf (LayerOf) is no JAX type to pass as an operand.
    # By the platform the program is lowered for (a target's, when compiled on a CPU host).
    # Few pairs gather on every platform but a CPU with the native kernel, which reads only
    # the chosen experts at any size. Many: XLA:GPU (and XLA:CPU without the kernel) expand
    # ragged_dot into a masked dot over every expert per pair, k times all_experts' FLOPs;
    # XLA:TPU has a grouped matmul of its own.
    few = gathers(x.shape[0], k, local_experts(layer))
    gpu = gathered_experts if few else all_experts
    tpu = gathered_experts if few else grouped_experts
    on_cpu = native_experts if native(layer, glu) else gpu
    if on_cpu is gpu is tpu:
        out = run(gpu)()
    else:
        out = jax.lax.platform_dependent(cpu=run(on_cpu), cuda=run(gpu), default=run(tpu))
    if "be_down" in layer:
        out = out + down_bias(layer, weights, experts, tp_axis)
    if local_experts(layer) < all_experts_count(layer):  # an ep shard's share
        out = jax.lax.psum(out, EP_AXIS)
    return out.reshape(*lead, d)

"""The pure-JAX decoder stack every model family runs, over a token-flattened ragged batch
and a paged KV cache: embedding, the layer loop (each layer the family's
``decoder_layer``: ``jserve.model.families``), the final norm and the LM head.

One call runs prefill chunks of several requests and single-token decodes together, writes
their KV into the cache pages, and computes logits only for the rows that will be sampled.
(The module keeps the name it had when Llama was the only family.)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.hybrid import group_layers
from jserve.cache.pool import HybridKV, KVCache
from jserve.config import ModelConfig
from jserve.kernels import (
    AttentionMetadata,
    attention,
    with_row_layouts,
    write_kv_pair,
    write_slots,
)
from jserve.kernels.blocks import with_sinks
from jserve.kernels.kv_parallel import kvp_attention, owned_slots
from jserve.model.families import family_of
from jserve.model.layer_weights import in_place, layer_view
from jserve.model.layers import layer_rope, rope_tables
from jserve.model.lora import with_slots
from jserve.model.moe import side_by_side
from jserve.model.params import Params
from jserve.model.tp_layout import EXPERTS, FUSED, fused_in


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """Device arrays of one engine step (every dimension padded to a bucket).

    tokens/slots [T]: input ids and flat KV slot (page * page_size + offset) of every token;
    padding tokens write to the reserved page 0. logits_rows [S]: the token whose hidden state
    gives each sequence row's next-token logits.

    KV-cache parallelism (``jserve.kernels.kv_parallel``): slots are then local to the token's
    owning group, slot_groups [T] names that group and start_groups [S] the group holding each
    row's first tokens; the engine always fills them (zeros on one group), other callers may
    leave them None when no ``kvp_axis`` is used.

    Two KV layer groups (``jserve.cache.hybrid``): slots and ``attn.page_table`` address the
    full-attention layers' pages, local_slots [T] and local_page_table [S, max_pages] the
    windowed layers' (None without the groups).

    LoRA adapters (``jserve.model.lora``): lora_slots [T] is each token's adapter slot in
    the pool (-1: the base model); None when the engine serves no adapters.
    """

    tokens: jax.Array
    slots: jax.Array
    logits_rows: jax.Array
    attn: AttentionMetadata
    slot_groups: jax.Array | None = None
    start_groups: jax.Array | None = None
    local_slots: jax.Array | None = None
    local_page_table: jax.Array | None = None
    lora_slots: jax.Array | None = None


def is_runtime_layout(params: Params) -> bool:
    """Stacked layers (a dict of ``[layers, ...]`` leaves), or the unrolled form of them
    (:func:`unstack_layers`: a list of per-layer dicts with fused leaves, ``tp_layout.FUSED``)."""
    layers = params["layers"]
    return isinstance(layers, dict) or bool(layers) and any(n in layers[0] for n in FUSED)


def to_runtime_layout(params: Params) -> Params:
    """The runtime layout ``forward`` takes: the layers stacked, one leaf ``[layers, ...]``
    per weight, so the layer loop is one ``fori_loop`` body whatever the depth (compile time
    does not grow with it), and each layer's matrices of one input side by side in one
    leaf (``tp_layout.FUSED``: ``wqkv``, ``w_gate_up``; one matmul instead of several).
    Checkpoints keep the HF-shaped per-layer list of :mod:`jserve.model`; params already in
    the runtime layout are returned as they are."""
    if is_runtime_layout(params):
        return params
    layers = params["layers"]
    stack = lambda ws: jax.tree.map(lambda *a: jnp.stack(a), *ws)  # quantized: both leaves
    fused = fused_in(layers[0])
    taken = {p for parts in fused.values() for p in parts}
    stacked = {name: stack([layer[name] for layer in layers])
               for name in layers[0] if name not in taken}
    for name, parts in fused.items():  # on the output axis (per-column scales follow it)
        stacked[name] = stack([jax.tree.map(lambda *ws, name=name: _fuse(name, ws),
                                            *(layer[p] for p in parts)) for layer in layers])
    return {**params, "layers": stacked}


def _fuse(name: str, parts) -> jax.Array:
    """One layer's fused leaf from its parts: side by side on the output axis; expert
    stacks [E, in, out] as every expert's parts in turn, [in, E * outs] (``tp_layout``)."""
    w = jnp.concatenate(parts, axis=-1)
    return side_by_side(w) if name in EXPERTS else w


def unstack_layers(params: Params) -> Params:
    """Runtime-layout ``params`` with the layers as a list of separate per-layer arrays: the
    forward then unrolls the layers instead of looping. Compile time grows with depth again,
    but no layer's weights are sliced out of a stacked array at run time, which XLA:CPU
    does by copying them every step (docs/startup.md: 2x slower decode at small batches)."""
    layers = params["layers"]
    if isinstance(layers, list):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": [jax.tree.map(lambda w, i=i: w[i], layers) for i in range(n)]}


def stack_layers(params: Params) -> Params:
    """The inverse of :func:`unstack_layers` (code that loops over traced layer indices)."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    return {**params, "layers": jax.tree.map(lambda *ws: jnp.stack(ws), *layers)}


def layer_params(layers: Params, i) -> Params:
    """Layer ``i`` (may be traced) of runtime-layout stacked ``layers``; of the unrolled
    list, ``i`` must be an int."""
    if isinstance(layers, list):
        return layers[i]
    if in_place():  # the matrices read where they lie (jserve.model.layer_weights)
        return layer_view(layers, i)
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), layers)


def embed(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The embedding rows of ``tokens``; a Gemma family's scaled by sqrt(hidden), the factor
    a float32 cast to the model's dtype first as HF does (bf16: sqrt(3072) is 55.5)."""
    x = params["embed"][tokens]
    if family_of(cfg).scaled_embedding:
        x = x * jnp.asarray(np.float32(cfg.hidden_size ** 0.5)).astype(x.dtype)
    return x


def decoder_layer(layer: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
                  attend: Callable, *, cfg: ModelConfig, tp_axis: str | None = None
                  ) -> tuple[jax.Array, Any]:
    """One decoder layer of ``cfg``'s family on the residual stream ``x`` [..., hidden]
    (token-flattened [T, hidden] when serving, [B, T, hidden] in training) -> (residual
    stream, aux); ``attend(q, k, v)`` is the attention core (:func:`step_layer`'s paged
    attention, aux the updated KV pages, or the trainer's dense masked attention). ``layer``
    is one layer of either layout; ``tp_axis`` names the mesh axis a tensor-parallel shard's
    partial outputs are summed over (``jserve.model.layers.pre_norm_layer``)."""
    return family_of(cfg).decoder_layer(layer, x, cos, sin, attend, cfg=cfg, tp_axis=tp_axis)


def layer_windows(cfg: ModelConfig) -> jax.Array | None:
    """Each layer's sliding window, int32 [layers] (0: full attention), which the serving
    step indexes by model layer to hand the attention its ``window``; None when no layer is
    windowed (the attention then compiles without any window code)."""
    if not any(cfg.layer_windows):
        return None
    return jnp.asarray(cfg.layer_windows, jnp.int32)


def _sunk(out: jax.Array, lse: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """The attention output with the layer's sinks where it has them (gpt-oss)."""
    return out if sinks is None else with_sinks(out, lse, sinks)


def step_layer(batch: StepInput, cos: jax.Array, sin: jax.Array, *, cfg: ModelConfig,
               attention_impl: str, tp_axis: str | None = None,
               kvp_axis: str | None = None, first_layer=0) -> Callable:
    """The serving step's ``layer_fn`` for :func:`layer_loop`, whose carry is the stacked KV
    cache (k_pages, v_pages) [layers, Hkv, P, S, D]: layer ``i`` writes this step's K/V into
    its pages in place and attends over them (``jserve.kernels.attention``). ``cos``/``sin``
    from ``rope_tables`` (each layer reads its own: ``layer_rope``); ``first_layer`` (may be
    traced): the model's index of the loop's layer 0 (a pipeline stage's first layer), for
    what is per layer in the config: the RoPE tables and the sliding window
    (:func:`layer_windows`).

    ``tp_axis`` as in :func:`decoder_layer`. ``kvp_axis`` names the mesh axis the KV pages are
    split over by token range (KV-cache parallelism, ``jserve.kernels.kv_parallel``): each
    group writes only the tokens it owns and attends to its own keys, and the partials are
    merged by LSE."""
    slots = batch.slots if kvp_axis is None else owned_slots(batch.slots, batch.slot_groups,
                                                             kvp_axis)
    windows = layer_windows(cfg)
    # Made once here, not in every layer of the loop (XLA left them in its body); kv-parallel
    # groups shift the positions, so their kernels make their own layouts.
    slots = write_slots(slots, attention_impl)
    local_slots = (None if batch.local_slots is None
                   else write_slots(batch.local_slots, attention_impl))
    attn = batch.attn if kvp_axis is not None else with_row_layouts(
        batch.attn, attention_impl, cfg.num_attention_heads // cfg.num_key_value_heads)

    def layer_fn(layer: Params, i, x: jax.Array, kv: KVCache) -> tuple[jax.Array, KVCache]:
        layer = with_slots(layer, batch.lora_slots)
        window = None if windows is None else windows[first_layer + i]
        if isinstance(kv, HybridKV):
            return _group_layer(layer, i, x, kv, window)

        def attend(q, k, v, sinks=None):
            k_pages, v_pages = write_kv_pair(kv[0], kv[1], slots, k, v, impl=attention_impl,
                                             layer=i)
            if kvp_axis is None:
                out, lse = attention(q, k_pages, v_pages, attn, impl=attention_impl,
                                     layer=i, window=window)
            else:
                out, lse = kvp_attention(q, k_pages, v_pages, attn, axis=kvp_axis,
                                         impl=attention_impl, start_groups=batch.start_groups,
                                         layer=i, window=window)
            return _sunk(out, lse, sinks), (k_pages, v_pages)

        return decoder_layer(layer, x, *layer_rope(cos, sin, cfg, first_layer + i), attend,
                             cfg=cfg, tp_axis=tp_axis)

    def _group_layer(layer: Params, i, x: jax.Array, kv: HybridKV, window):
        """Layer ``i`` (a Python int: the layers unrolled) on its group's pages, slots and
        page table (``jserve.cache.hybrid``)."""
        if not isinstance(i, int) or kvp_axis is not None:
            raise ValueError("two KV layer groups need the layers unrolled and no kvp")
        local, j = group_layers(cfg)[first_layer + i]
        pages = kv.loc if local else kv.glob
        at = local_slots if local else slots
        meta = (dataclasses.replace(attn, page_table=batch.local_page_table) if local
                else attn)

        def attend(q, k, v, sinks=None):
            k_pages, v_pages = write_kv_pair(pages[0], pages[1], at, k, v,
                                             impl=attention_impl, layer=j)
            out, lse = attention(q, k_pages, v_pages, meta, impl=attention_impl, layer=j,
                                 window=window)
            return _sunk(out, lse, sinks), (k_pages, v_pages)

        x, new = decoder_layer(layer, x, *layer_rope(cos, sin, cfg, first_layer + i), attend,
                               cfg=cfg, tp_axis=tp_axis)
        return x, kv._replace(**{"loc" if local else "glob": new})

    return layer_fn


def layer_loop(layers: Params, x: jax.Array, carry: Any, layer_fn: Callable, start: int,
               stop: int, *, collect: Callable | None = None) -> tuple[jax.Array, Any, Any]:
    """The decoder-layer loop, the one every caller runs (the serving step, each pipeline
    stage, the probe's dataset, the trainer): ``x, carry = layer_fn(layer, i, x, carry)`` for
    layers ``[start, stop)`` of ``layers``.

    Stacked ``layers`` (one ``[layers, ...]`` leaf per weight) run as one loop whose body is
    traced and compiled once at any depth (``i`` traced); a list of per-layer dicts
    (:func:`unstack_layers`, or the checkpoint layout) is unrolled (``i`` an int). Returns
    (x, carry, collected): ``collect(x)`` after every layer, stacked [stop - start, ...]
    (None without ``collect``)."""
    if isinstance(layers, list):
        seen = []
        for i in range(start, stop):
            x, carry = layer_fn(layers[i], i, x, carry)
            if collect is not None:
                seen.append(collect(x))
        return x, carry, jnp.stack(seen) if collect is not None else None
    if collect is not None:
        def scan_body(xc, i):
            x, carry = layer_fn(layer_params(layers, i), i, *xc)
            return (x, carry), collect(x)

        (x, carry), seen = jax.lax.scan(scan_body, (x, carry), jnp.arange(start, stop))
        return x, carry, seen
    if stop <= start:
        return x, carry, None

    def body(i, xc):
        return layer_fn(layer_params(layers, i), i, *xc)

    x, carry = jax.lax.fori_loop(start, stop, body, (x, carry))
    return x, carry, None


def head_logits(params: Params, x: jax.Array, cfg: ModelConfig,
                vocab_major: bool = False) -> jax.Array:
    """float32 logits [..., vocab] of the residual stream ``x`` [..., hidden]: the family's
    final norm, then the LM head (the embedding when tied), then the tanh cap where the
    config sets ``final_logit_softcapping`` (Gemma): the one place logits are made, so
    sampling, logprobs, prompt logprobs and speculative checks all see it.
    ``vocab_major`` (``x`` [S, hidden]): the logits [vocab, S], as the step's sampling takes
    them (``SampleInputs``). On XLA:CPU the head's product with the vocabulary on its major
    side ran 1.4x as fast as the [S, vocab] one at 32 rows x 32K tokens (9.1 -> 6.4 ms;
    ``scripts/profile_ops.py``), and a transpose after it cost XLA:CPU more than that
    (each consumer copied it), so the sampling reads that layout itself. One row is the
    same memory either way; it keeps the [1, vocab] product, XLA:CPU's faster one there."""
    h = family_of(cfg).norm(x, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]  # [vocab, d]
    logits = head_product(head, h, vocab_major)
    if (cap := cfg.final_logit_softcapping) is not None:
        logits = jnp.tanh(logits / cap) * cap
    return logits


def head_product(head: jax.Array, h: jax.Array, vocab_major: bool) -> jax.Array:
    """The LM head's matmul in ``head_logits``' orientation (``head`` [vocab, d]); the
    matmul ceiling of ``scripts/harness/decode_step.py`` times the same product."""
    if vocab_major and h.shape[0] > 1:
        return jnp.einsum("vd,sd->vs", head, h, preferred_element_type=jnp.float32)
    logits = jnp.einsum("...d,vd->...v", h, head, preferred_element_type=jnp.float32)
    return logits.reshape(-1, 1) if vocab_major else logits


def final_logits(params: Params, x: jax.Array, rows: jax.Array, cfg: ModelConfig,
                 vocab_major: bool = False) -> jax.Array:
    """float32 logits [S, vocab] of the residual stream's ``rows`` (``vocab_major``:
    [vocab, S])."""
    return head_logits(params, x[rows], cfg, vocab_major)


class Capture(NamedTuple):
    """The residual stream after one layer, what an output-length probe reads, or the final
    norm's output, what embedding models pool (float32).

    rows [S, hidden]: at each sequence row's ``logits_rows`` token. prompt_sum [S, hidden]:
    the sum over each row's tokens that ``prompt_mask`` marks (all of them when no mask), so
    the host can build a mean prompt embedding across prefill chunks."""

    rows: jax.Array
    prompt_sum: jax.Array


def forward(params: Params, kv_cache: KVCache, batch: StepInput, *, cfg: ModelConfig,
            attention_impl: str = "reference", tp_axis: str | None = None,
            kvp_axis: str | None = None, capture_layer: int | None = None,
            prompt_mask: jax.Array | None = None) -> tuple[jax.Array, KVCache, Capture | None]:
    """Returns (float32 logits [S, vocab] for ``batch.logits_rows``, updated KV cache, capture).

    ``params`` must be in the runtime layout of :func:`to_runtime_layout`; ``tp_axis`` and
    ``kvp_axis`` as in :func:`step_layer`. ``capture`` is the :class:`Capture` after layer
    ``capture_layer`` (0-based; ``None``: nothing captured and nothing extra computed);
    ``prompt_mask`` [T] picks the tokens its ``prompt_sum`` adds up."""
    x, kv_cache, hidden = forward_stream(
        params, kv_cache, batch, cfg=cfg, attention_impl=attention_impl, tp_axis=tp_axis,
        kvp_axis=kvp_axis, capture_layer=capture_layer, prompt_mask=prompt_mask)
    return final_logits(params, x, batch.logits_rows, cfg), kv_cache, hidden


def forward_stream(params: Params, kv_cache: KVCache, batch: StepInput, *, cfg: ModelConfig,
                   attention_impl: str = "reference", tp_axis: str | None = None,
                   kvp_axis: str | None = None, capture_layer: int | None = None,
                   prompt_mask: jax.Array | None = None
                   ) -> tuple[jax.Array, KVCache, Capture | None]:
    """``forward`` up to the residual stream of every token after the last layer [T, hidden]
    (what prompt logprobs take the LM head of), before the final norm and head.
    ``capture_layer`` == the number of layers captures the final norm's output (what
    embedding models pool, ``jserve.engine.requests.pooling``)."""
    x = embed(params, batch.tokens, cfg)
    cos, sin = rope_tables(cfg, batch.attn.positions)
    layers = params["layers"]
    layer_fn = step_layer(batch, cos, sin, cfg=cfg, attention_impl=attention_impl,
                          tp_axis=tp_axis, kvp_axis=kvp_axis)
    num_layers = len(layers) if isinstance(layers, list) else jax.tree.leaves(layers)[0].shape[0]
    hidden = None
    if capture_layer is None:
        x, kv_cache, _ = layer_loop(layers, x, kv_cache, layer_fn, 0, num_layers)
    else:  # two loops around the captured layer's output
        x, kv_cache, _ = layer_loop(layers, x, kv_cache, layer_fn, 0,
                                    min(capture_layer + 1, num_layers))
        h = (x if capture_layer < num_layers else family_of(cfg).norm(
            x, params["final_norm"], cfg.rms_norm_eps)).astype(jnp.float32)
        xf = h if prompt_mask is None else jnp.where(prompt_mask[:, None], h, 0.0)
        s = batch.logits_rows.shape[0]  # padding tokens carry token_seq == s: dropped
        sums = jax.ops.segment_sum(xf, batch.attn.token_seq, num_segments=s + 1)[:s]
        hidden = Capture(h[batch.logits_rows], sums)
        if capture_layer + 1 < num_layers:
            x, kv_cache, _ = layer_loop(layers, x, kv_cache, layer_fn, capture_layer + 1,
                                        num_layers)
    return x, kv_cache, hidden

"""Stream pipeline parallelism (``spp``): the layers split into ``spp`` contiguous stages, one
microbatch per stage, every stage busy on every tick.

Layout. Layer ``s * L/spp + j`` is stage ``s``'s ``j``-th layer. The runtime params are
already stacked ``[L, ...]`` and the KV cache ``[L, KV heads, pages, page_size, head_dim]``
(:mod:`jserve.model.decoder`); their leading layer dim is split on ``"spp"``
(``sharding.specs.param_specs``, ``STACKED_KV_SPEC``), so a stage holds only its own layers
and their pages and runs them through the model's layer loop (``layer_loop``), unrolled over
per-layer arrays when the runner splits the stack by stage (``unstack_stages``: a tuple of
layers whose leaves keep the ``"spp"`` axis). Page ids are global (one allocator), so every
stage stores the same pages for different layers.

Tick. One ``jax.shard_map`` over the whole mesh: stage 0 embeds the new batch, every stage
runs its layers on the microbatch it holds, and the residual stream moves one stage on with
a cyclic ``ppermute``. The wrap-around puts the stream of the batch that left the last stage
in slot 0 of the carry (stage 0 overwrites slot 0 with the next new batch), where the caller
takes it through ``final_logits`` and sampling.

Shapes. A tick has the shape ``(decodes, prefill tokens)`` of the smallest bucket covering
every batch in the pipeline, so a lone decode runs a decode-sized tick. The host sends every
slot's packed step buffers at that shape each tick (``[spp, size]``; slot ``s``: the batch
stage ``s`` runs, slot 0 the new one), so only the residual stream stays on device
(``PipelineCarry``), at one fixed canonical size whatever the tick: ``decode_rows`` rows for
decode tokens (token ``i`` at row ``i``) then the largest prefill chunk (prefill token ``j``
at row ``decode_rows + j``). A tick reads and writes its tokens' rows of it (``stream_rows``)
and moves only those rows, so a batch finds its stream where it left it under any later
tick shape that covers it.

Pass. A batch alone in an empty pipeline (nothing else to run) does not need ``spp`` ticks
(``spp`` host steps) to come out: ``lone_pass`` runs it through every stage in one
executable, ``spp`` rounds of "every stage runs its layers, the stream moves one stage on",
and returns the stream that left the last stage. Only the stage holding the batch in a
round writes its KV (the others write to the sink slot 0, and their stream is discarded),
so the cache ends as ``spp`` ticks would leave it. The carry is neither read nor written:
the pipeline is empty before and after.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jserve.cache.pool import KVCache
from jserve.config import ModelConfig
from jserve.kernels.kv_parallel import local_page_table
from jserve.model.decoder import embed, layer_loop, step_layer
from jserve.model.layers import rope_tables
from jserve.model.params import Params
from sharding.specs import kv_cache_specs, param_specs

STAGE_SPEC = P("spp")                # carry leaves: [spp, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineCarry:
    """What each stage holds between ticks: slot ``s`` is the residual stream of the
    microbatch entering stage ``s`` on the next tick (slot 0: the batch that just left the
    last stage), in the canonical layout (module docstring)."""

    x: jax.Array     # [spp, decode_rows + prefill_tokens, hidden]


def unstack_stages(params: Params, spp: int) -> Params:
    """Runtime params with each stage's layers as separate arrays: a tuple of L/spp layer
    dicts whose leaves are ``[spp, ...]`` (row ``s``: stage ``s``'s ``j``-th layer), split on
    ``spp`` like the stack, so a stage unrolls its layers instead of slicing each out of the
    stack, which XLA:CPU does by copying the weights every tick (``unstack_layers`` for
    one device)."""
    layers = params["layers"]
    if not isinstance(layers, dict):
        return params
    lps = jax.tree.leaves(layers)[0].shape[0] // spp
    stage = lambda w, j: w.reshape(spp, lps, *w.shape[1:])[:, j]
    return {**params, "layers": tuple(jax.tree.map(lambda w, j=j: stage(w, j), layers)
                                      for j in range(lps))}


def validate(cfg: ModelConfig, spp: int) -> None:
    if cfg.num_hidden_layers % spp:
        raise ValueError(f"spp={spp} does not divide num_hidden_layers={cfg.num_hidden_layers}")


def layers_per_stage(cfg: ModelConfig, spp: int) -> int:
    validate(cfg, spp)
    return cfg.num_hidden_layers // spp


def carry_spec(mesh: Mesh, cfg: ModelConfig, tokens: int) -> PipelineCarry:
    """Abstract carry (shape and sharding) for lowering the tick; ``tokens``: the canonical
    rows (largest decode rows plus largest prefill chunk)."""
    spp = mesh.shape["spp"]
    return PipelineCarry(jax.ShapeDtypeStruct((spp, tokens, cfg.hidden_size), cfg.np_dtype,
                                              sharding=NamedSharding(mesh, STAGE_SPEC)))


def empty_carry(mesh: Mesh, cfg: ModelConfig, tokens: int) -> PipelineCarry:
    """A zero residual stream in every slot (empty slots: all-padding steps, whose writes go
    to the sink page 0 and which sample no row)."""
    spp = mesh.shape["spp"]
    return jax.device_put(PipelineCarry(jnp.zeros((spp, tokens, cfg.hidden_size),
                                                  cfg.np_dtype)),
                          NamedSharding(mesh, STAGE_SPEC))


def stream_rows(x: jax.Array, decodes: int, tokens: int, decode_rows: int) -> jax.Array:
    """The ``tokens`` rows of a tick with ``decodes`` decode rows out of one canonical stream
    ``x`` [rows, hidden]: rows ``[0, decodes)`` then ``[decode_rows, decode_rows + tokens -
    decodes)``."""
    return jnp.concatenate([x[:decodes], x[decode_rows:decode_rows + tokens - decodes]])


def put_stream_rows(x: jax.Array, rows: jax.Array, decodes: int, decode_rows: int
                    ) -> jax.Array:
    """``x`` with the tick's ``rows`` written back where ``stream_rows`` read them."""
    x = jax.lax.dynamic_update_slice_in_dim(x, rows[:decodes], 0, 0)
    return jax.lax.dynamic_update_slice_in_dim(x, rows[decodes:], decode_rows, 0)


def exiting(carry: PipelineCarry, decodes: int, tokens: int, decode_rows: int) -> jax.Array:
    """The residual stream of the batch that left the last stage, at the tick's shape."""
    return stream_rows(carry.x[0], decodes, tokens, decode_rows)


def _stage_batch(batch, kvp: int):
    """With ``kvp`` > 1 every stage runs KV-cache-parallel attention: the batch travels whole,
    so each group takes its own columns of the page table here (what ``PAGE_TABLE_SPEC``
    does for the unpipelined step)."""
    if kvp == 1:
        return batch
    table = batch.attn.page_table
    local = local_page_table(table, jax.lax.axis_index("kvp"), table.shape[1] // kvp)
    return dataclasses.replace(batch, attn=dataclasses.replace(batch.attn, page_table=local))


def _stage_layers(params: Params):
    """This stage's layers inside the shard_map: the stack's local slice, or with
    ``unstack_stages`` its [1, ...] arrays per layer as a list of layers."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        layers = [jax.tree.map(lambda w: w.reshape(w.shape[1:]), layer) for layer in layers]
    return layers


def _stage_runner(mesh: Mesh, cfg: ModelConfig, attention_impl: str):
    """What ``tick`` and ``lone_pass`` share inside the shard_map: the ring permutation that
    moves a stream one stage on, and ``run(params, x, kv_cache, batch)``, this stage's layers
    on ``batch`` (tp psums and kvp attention only where those axes have more than one
    device)."""
    spp = mesh.shape["spp"]
    lps = layers_per_stage(cfg, spp)
    kvp_axis = "kvp" if mesh.shape["kvp"] > 1 else None
    tp_axis = "tp" if mesh.shape["tp"] > 1 else None  # no psum over one device per layer

    def run(params, x, kv_cache, batch):
        cos, sin = rope_tables(cfg, batch.attn.positions)
        layer_fn = step_layer(batch, cos, sin, cfg=cfg, attention_impl=attention_impl,
                              tp_axis=tp_axis, kvp_axis=kvp_axis,
                              first_layer=jax.lax.axis_index("spp") * lps)
        x, kv_cache, _ = layer_loop(_stage_layers(params), x, kv_cache, layer_fn, 0, lps)
        return x, kv_cache

    return [(s, (s + 1) % spp) for s in range(spp)], run


def tick(params: Params, kv_cache: KVCache, carry: PipelineCarry, ibufs: jax.Array,
         fbufs: jax.Array, *, unpack: Callable, decode_rows: int, mesh: Mesh,
         cfg: ModelConfig, attention_impl: str) -> tuple[KVCache, PipelineCarry]:
    """One pipeline tick. ``ibufs``/``fbufs`` [spp, size] (replicated): row ``s`` is the
    packed step of the batch stage ``s`` runs (row 0 the new batch, entering stage 0), all
    at the tick's shape; ``unpack(ibuf, fbuf)`` turns one row into ``StepArrays``.
    ``decode_rows``: the carry's canonical decode rows. Returns the updated KV cache and
    carry; ``exiting`` gives the stream of the batch that left the last stage (the one in
    row ``spp - 1``); ``_stage_batch`` for ``kvp`` > 1."""
    kvp = mesh.shape["kvp"]
    perm, run = _stage_runner(mesh, cfg, attention_impl)

    def local(params, kv_cache, carry, ibufs, fbufs):
        stage = jax.lax.axis_index("spp")
        first = stage == 0
        batch = _stage_batch(unpack(jax.lax.dynamic_index_in_dim(ibufs, stage, keepdims=False),
                                    jax.lax.dynamic_index_in_dim(fbufs, stage,
                                                                 keepdims=False)).batch, kvp)
        decodes, tokens = batch.attn.num_decodes, batch.tokens.shape[0]
        held = carry.x[0]
        x = jnp.where(first, embed(params, batch.tokens, cfg),
                      stream_rows(held, decodes, tokens, decode_rows))
        x, kv_cache = run(params, x, kv_cache, batch)
        # Only the tick's rows travel; the slot's other rows keep stale values that no
        # batch covered by a later tick reads as its own (they are its padding).
        moved = jax.lax.ppermute(x, "spp", perm)
        return kv_cache, PipelineCarry(put_stream_rows(held, moved, decodes, decode_rows)[None])

    specs = kv_cache_specs()
    carry_specs = PipelineCarry(STAGE_SPEC)
    # check_vma off for the same reason as tp_forward (kernel loop carries); replication of
    # the moved carry over tp holds by construction (psum'd residual stream).
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(param_specs(params), specs, carry_specs, P(), P()),
                         out_specs=(specs, carry_specs), check_vma=False)(
        params, kv_cache, carry, ibufs, fbufs)


def lone_pass(params: Params, kv_cache: KVCache, ibuf: jax.Array, fbuf: jax.Array, *,
              unpack: Callable, mesh: Mesh, cfg: ModelConfig, attention_impl: str
              ) -> tuple[KVCache, jax.Array]:
    """One batch through every stage in one executable (module docstring, Pass): ``ibuf`` /
    ``fbuf`` [size] (replicated) its packed step at its own shape. Returns the updated KV
    cache and the stream that left the last stage, [tokens, hidden]."""
    spp, kvp = mesh.shape["spp"], mesh.shape["kvp"]
    perm, run = _stage_runner(mesh, cfg, attention_impl)

    def local(params, kv_cache, ibuf, fbuf):
        stage = jax.lax.axis_index("spp")
        batch = _stage_batch(unpack(ibuf, fbuf).batch, kvp)
        x = embed(params, batch.tokens, cfg)
        for i in range(spp):
            # Stage i holds the batch this round; every other stage's work is discarded and
            # writes its KV to the sink slot.
            slots = jnp.where(stage == i, batch.slots, 0)
            x, kv_cache = run(params, x, kv_cache, dataclasses.replace(batch, slots=slots))
            x = jax.lax.ppermute(x, "spp", perm)
        return kv_cache, x[None]  # stage 0 now holds what left the last stage

    specs = kv_cache_specs()
    kv_cache, x = jax.shard_map(local, mesh=mesh,
                                in_specs=(param_specs(params), specs, P(), P()),
                                out_specs=(specs, STAGE_SPEC), check_vma=False)(
        params, kv_cache, ibuf, fbuf)
    return kv_cache, x[0]

"""The device side of the engine: one fused jitted step (forward, penalty state, sampling)
compiled ahead of time per bucket, with a compile counter tests read. The sampling is also
its own executable, shared by every shape: a pipeline tick or pass (spp > 1) and a step
whose masks come late run it after the forward. (The name follows
vLLM's ``ModelRunner``; it is the only ``runner`` module in the package.)"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.pool import KVCache
from jserve.config import LlamaConfig
from jserve.engine import burst
from jserve.engine.buckets import Buckets
from jserve.engine.deferred import DeferredCompiles
from jserve.kernels import AttentionMetadata
from jserve.model.llama import (
    Params,
    StepInput,
    final_logits,
    forward,
    prepare_params,
    unstack_layers,
)
from jserve.sampling.params import MAX_BANNED_IDS, MAX_LOGPROBS
from jserve.sampling.sampler import (
    SampleResult,
    SamplingBatch,
    apply_penalties,
    choose_tokens,
    mask_words,
    pad_rows,
    token_logprobs,
)
from sharding import pipeline
from sharding.specs import param_specs, shard_params
from sharding.tensor_parallel import tp_forward

log = logging.getLogger(__name__)

# Persistent compilation cache lookups in this process ("cache_hits" / "cache_misses"), so
# the engine can say at start how much of its compile came from the cache.
CACHE_EVENTS: collections.Counter = collections.Counter()


# The same events of the programs a runner compiles (``_compile``): the listener runs in
# the compiling thread, so a thread-local counter tells them from other threads' programs
# (the weights loading beside them).
_PROGRAM_EVENTS = threading.local()


def _count_cache_event(event: str, **_) -> None:
    if event.startswith("/jax/compilation_cache/cache_"):
        name = event.rsplit("/", 1)[1]
        CACHE_EVENTS[name] += 1
        counter = getattr(_PROGRAM_EVENTS, "counter", None)
        if counter is not None:
            counter[name] += 1


jax.monitoring.register_event_listener(_count_cache_event)


def _compile(lowered: jax.stages.Lowered, counter: collections.Counter) -> jax.stages.Compiled:
    """``lowered.compile()``, its persistent-cache hits and misses added to ``counter``."""
    _PROGRAM_EVENTS.counter = counter
    try:
        return lowered.compile()
    finally:
        _PROGRAM_EVENTS.counter = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SeqState:
    """Per-sequence device state: for penalties, generated-token counts and prompt membership;
    for async scheduling, the sequence's last sampled token.

    Rows are handed to running sequences; a row is reset when its sequence's first chunk
    (position 0) runs, and filled from the tokens the forward pass consumes, so recompute after
    preemption rebuilds it exactly. ``last_tokens`` is written by the sampler and read by the
    next step for tokens the host has not seen yet (``StepArrays.token_fed``). The last row
    is a sink for padding.
    """

    output_counts: jax.Array  # [R, V] int32
    prompt_mask: jax.Array    # [R, V] bool
    last_tokens: jax.Array    # [R] int32


class _SamplerKey(NamedTuple):
    """The sampling executable of ``rows`` rows in the background compile queue (beside
    step shapes)."""

    rows: int


class _BurstKey(NamedTuple):
    """A decode burst's executable (``steps`` steps of an all-decode ``shape``) in the
    background compile queue."""

    shape: tuple[int, int]
    steps: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Everything one step sends to the device (see ``StepBuilder``)."""

    batch: StepInput
    token_state_rows: jax.Array  # [T]
    token_is_prompt: jax.Array   # [T]
    token_fed: jax.Array         # [T] bool: the token is its sequence's ``last_tokens`` entry
    state_rows: jax.Array        # [S]
    reset_rows: jax.Array        # [S]
    sampled_state_rows: jax.Array  # [S] where the row's sampled token is kept (sink: nowhere)
    sampling: SamplingBatch
    any_random: jax.Array        # scalar bool: some row samples (else argmax only)
    any_penalty: jax.Array       # scalar bool: some row uses penalties (else skip their work)
    want_logprobs: jax.Array     # scalar bool


def _update_state(state: SeqState, tokens, rows, is_prompt, reset_rows) -> SeqState:
    sink = state.output_counts.shape[0] - 1
    counts = state.output_counts.at[reset_rows].set(0)
    mask = state.prompt_mask.at[reset_rows].set(False)
    counts = counts.at[rows, tokens].add(jnp.where(is_prompt, 0, 1).astype(counts.dtype))
    mask = mask.at[jnp.where(is_prompt, rows, sink), tokens].set(True)
    return dataclasses.replace(state, output_counts=counts, prompt_mask=mask)


class PackedLayout:
    """Where each leaf of a bucket's ``StepArrays`` sits in two flat buffers (int32, float32).

    One host-to-device copy per buffer instead of one per leaf: with ~25 small leaves the
    per-transfer cost was over a tenth of a decode step on CPU. Bools travel as int32, uint32
    seeds as their int32 bit pattern.
    """

    def __init__(self, spec: StepArrays):
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(spec)
        self.fields: list[tuple[np.dtype, tuple[int, ...], bool, int]] = []
        # leaf path -> (offset in ints, shape) of every int leaf
        self._int_at: dict[str, tuple[int, tuple[int, ...]]] = {}
        sizes = [0, 0]
        for path, leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            is_float = dtype == np.float32
            n = int(np.prod(leaf.shape))
            self.fields.append((dtype, tuple(leaf.shape), is_float, sizes[is_float]))
            if not is_float:
                self._int_at[jax.tree_util.keystr(path)] = (sizes[0], tuple(leaf.shape))
            sizes[is_float] += n
        self.int_size, self.float_size = sizes

    def feed(self, ibuf: jax.Array, last_tokens: jax.Array) -> jax.Array:
        """``ibuf`` with every token marked ``token_fed`` replaced by its sequence's last
        sampled token (on device: the host has not read it yet). Works on the packed buffer,
        so the plain step and the pipeline tick feed the same way."""
        leaf = functools.partial(self.int_leaf, ibuf)
        tokens = jnp.where(leaf(".token_fed") != 0, last_tokens[leaf(".token_state_rows")],
                           leaf(".batch.tokens"))
        return self.with_int_leaf(ibuf, ".batch.tokens", tokens)

    def int_leaf(self, ibuf: jax.Array, name: str) -> jax.Array:
        """The int leaf at path ``name`` (e.g. ".batch.tokens") of a packed buffer, as stored
        (int32; bools as 0/1)."""
        offset, shape = self._int_at[name]
        n = int(np.prod(shape))
        return jax.lax.slice_in_dim(ibuf, offset, offset + n).reshape(shape)

    def with_int_leaf(self, ibuf: jax.Array, name: str, value: jax.Array) -> jax.Array:
        """``ibuf`` with the leading entries of leaf ``name`` replaced by ``value``."""
        offset, _ = self._int_at[name]
        return jax.lax.dynamic_update_slice_in_dim(ibuf, value.astype(jnp.int32).ravel(),
                                                   offset, 0)

    def pack(self, arrays: StepArrays) -> tuple[np.ndarray, np.ndarray]:
        """The two buffers; ``np.concatenate`` casts as it copies (bools to int32), so a
        leaf is copied once."""
        ints, floats = [], []
        for (dtype, _, is_float, _), leaf in zip(self.fields, jax.tree.leaves(arrays)):
            flat = np.asarray(leaf, dtype).ravel()
            if is_float:
                floats.append(flat)
            else:
                ints.append(flat.view(np.int32) if dtype == np.uint32 else flat)
        return np.concatenate(ints, dtype=np.int32), np.concatenate(floats)

    def unpack(self, ibuf: jax.Array, fbuf: jax.Array) -> StepArrays:
        leaves = []
        for dtype, shape, is_float, offset in self.fields:
            n = int(np.prod(shape))
            flat = jax.lax.slice_in_dim(fbuf if is_float else ibuf, offset, offset + n)
            if dtype == np.bool_:
                flat = flat != 0
            elif dtype == np.uint32:
                flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
            leaves.append(flat.reshape(shape))
        return jax.tree.unflatten(self.treedef, leaves)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInputs:
    """What the step hands the sampling executable, every row padded to the engine's largest
    row count: one sampling program (the full-vocabulary sort, top-k logprobs) serves every
    step shape instead of being compiled into each."""

    logits: jax.Array          # [R, vocab] float32
    state_rows: jax.Array      # [R]
    sampled_state_rows: jax.Array  # [R]
    sampling: SamplingBatch    # [R] rows
    any_random: jax.Array
    any_penalty: jax.Array
    want_logprobs: jax.Array


def _sample_inputs(logits: jax.Array, state: SeqState, arrays: StepArrays, rows: int,
                   mesh: jax.sharding.Mesh | None) -> tuple[SampleInputs, SeqState]:
    """The step's tail after the forward (shared by the plain step, the pipeline tick and
    the lone pass): the penalty state update, which reads the step's tokens, then the
    sampling inputs padded to ``rows``, replicated over ``mesh`` as the sampling executable
    takes them (multi-process leaders read their own copy; the donated state keeps its
    input sharding). Runtime choice (no recompile): penalty bookkeeping only when some row
    uses penalties (a row is reset at its sequence's first chunk, so skipped steps leave
    nothing stale that a penalised request reads)."""
    state = jax.lax.cond(
        arrays.any_penalty,
        lambda: _update_state(state, arrays.batch.tokens, arrays.token_state_rows,
                              arrays.token_is_prompt, arrays.reset_rows),
        lambda: state)
    pad = rows - logits.shape[0]
    sink = state.output_counts.shape[0] - 1
    inputs = SampleInputs(
        logits=jnp.pad(logits, ((0, pad), (0, 0))),
        state_rows=jnp.pad(arrays.state_rows, (0, pad), constant_values=sink),
        sampled_state_rows=jnp.pad(arrays.sampled_state_rows, (0, pad), constant_values=sink),
        sampling=pad_rows(arrays.sampling, rows), any_random=arrays.any_random,
        any_penalty=arrays.any_penalty, want_logprobs=arrays.want_logprobs)
    if mesh is None:
        return inputs, state
    return jax.lax.with_sharding_constraint(
        (inputs, state), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _sample(state: SeqState, inp: SampleInputs) -> tuple[SampleResult, SeqState]:
    """Penalties, token choice and logprobs on the padded rows (one executable); the chosen
    tokens are kept in ``state.last_tokens`` for the next step. Runtime choices: penalties
    only when some row uses them, the sort only when some row samples, top-n logprobs only
    when asked."""
    logits, sb = inp.logits, inp.sampling
    penalised = jax.lax.cond(
        inp.any_penalty,
        lambda: apply_penalties(logits, state.output_counts[inp.state_rows],
                                state.prompt_mask[inp.state_rows], sb),
        lambda: logits)
    tokens = jax.lax.cond(inp.any_random,
                          lambda: choose_tokens(penalised, sb, all_greedy=False),
                          lambda: choose_tokens(penalised, sb, all_greedy=True))
    s = logits.shape[0]
    chosen, top_ids, top_lp = jax.lax.cond(
        inp.want_logprobs,
        lambda: token_logprobs(logits, tokens, MAX_LOGPROBS),
        lambda: (jnp.zeros((s,), jnp.float32), jnp.zeros((s, MAX_LOGPROBS), jnp.int32),
                 jnp.zeros((s, MAX_LOGPROBS), jnp.float32)))
    last = state.last_tokens.at[inp.sampled_state_rows].set(tokens)
    return (SampleResult(tokens, chosen, top_ids, top_lp),
            dataclasses.replace(state, last_tokens=last))


def _forward_step(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array,
                  fbuf: jax.Array, *, layout: PackedLayout, cfg: LlamaConfig,
                  attention_impl: str, mesh: jax.sharding.Mesh | None, rows: int,
                  capture_layer: int | None = None, slice_layers: bool = False):
    """The forward of one bucket and the penalty state update; returns (SampleInputs, KV
    cache, state). With ``capture_layer`` set, a fourth output: the layer's ``Capture``
    (prompt sums over the step's prompt tokens); ``None`` compiles exactly the step without
    it. ``slice_layers``: stacked params, the layers unrolled over static slices of them
    (``EngineConfig.layer_loop`` "sliced": on GPU neither the loop's weight copies nor an
    argument per layer weight)."""
    if slice_layers:
        params = unstack_layers(params)
    arrays = layout.unpack(layout.feed(ibuf, state.last_tokens), fbuf)
    if mesh is None:
        logits, kv_cache, capture = forward(
            params, kv_cache, arrays.batch, cfg=cfg, attention_impl=attention_impl,
            capture_layer=capture_layer,
            prompt_mask=arrays.token_is_prompt if capture_layer is not None else None)
    else:  # tensor / KV-cache parallel; the rest of the step runs replicated on the logits
        logits, kv_cache = tp_forward(params, kv_cache, arrays.batch, mesh=mesh, cfg=cfg,
                                      attention_impl=attention_impl)
    inputs, state = _sample_inputs(logits, state, arrays, rows, mesh)
    if capture_layer is not None:
        return inputs, kv_cache, state, capture
    return inputs, kv_cache, state


def _step(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array, fbuf: jax.Array,
          *, layout: PackedLayout, cfg: LlamaConfig, attention_impl: str,
          mesh: jax.sharding.Mesh | None, rows: int, capture_layer: int | None = None,
          slice_layers: bool = False):
    """The plain step (spp == 1): ``_forward_step`` and the sampling in one executable, so
    the logits never leave it and the host dispatches one call a step. Returns
    (SampleResult, SampleInputs, KV cache, state[, Capture]); the ``SampleInputs`` serve a
    step whose sampling waits for masks the host computes while it runs (``late_masks``):
    the sampling executable samples them again with those masks, overwriting the tokens
    this one kept in ``state.last_tokens`` before anything reads them."""
    inputs, kv_cache, state, *capture = _forward_step(
        params, kv_cache, state, ibuf, fbuf, layout=layout, cfg=cfg,
        attention_impl=attention_impl, mesh=mesh, rows=rows, capture_layer=capture_layer,
        slice_layers=slice_layers)
    out, state = _sample(state, inputs)
    return (out, inputs, kv_cache, state, *capture)


def _burst(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array,
           fbuf: jax.Array, *, layout: PackedLayout, cfg: LlamaConfig, attention_impl: str,
           mesh: jax.sharding.Mesh | None, rows: int, slice_layers: bool, steps: int,
           num_decodes: int, page_size: int):
    """``steps`` plain steps of an all-decode bucket in one program (``jserve.engine.burst``);
    returns (tokens [steps, rows], KV cache, state)."""
    def step(kv, st, buf):
        out, _, kv, st = _step(params, kv, st, buf, fbuf, layout=layout, cfg=cfg,
                               attention_impl=attention_impl, mesh=mesh, rows=rows,
                               slice_layers=slice_layers)
        return out, kv, st
    return burst.run_burst(step, ibuf, kv_cache, state, layout=layout, steps=steps, rows=rows,
                           num_decodes=num_decodes, page_size=page_size)


def _tick(params: Params, kv_cache: KVCache, state: SeqState, carry: pipeline.PipelineCarry,
          ibufs: jax.Array, fbufs: jax.Array, *, layout: PackedLayout, cfg: LlamaConfig,
          attention_impl: str, mesh: jax.sharding.Mesh, rows: int, decode_rows: int):
    """A stream-pipeline tick (``sharding.pipeline.tick``; ``ibufs``/``fbufs`` [spp, size]:
    every stage's batch at the tick's shape), then the plain step's tail on the batch that
    left the last stage (the last row; replicated, outside the shard_map). Every slot's fed
    tokens are filled in: the host resends a batch's buffers each tick, and a sequence's
    ``last_tokens`` entry does not change while its batch is in flight (its sampled chunk is
    its only one in the pipeline)."""
    ibufs = jax.vmap(layout.feed, in_axes=(0, None))(ibufs, state.last_tokens)
    kv_cache, carry = pipeline.tick(params, kv_cache, carry, ibufs, fbufs, unpack=layout.unpack,
                                    decode_rows=decode_rows, mesh=mesh, cfg=cfg,
                                    attention_impl=attention_impl)
    arrays = layout.unpack(ibufs[-1], fbufs[-1])
    x = pipeline.exiting(carry, arrays.batch.attn.num_decodes, arrays.batch.tokens.shape[0],
                         decode_rows)
    logits = final_logits(params, x, arrays.batch.logits_rows, cfg)
    inputs, state = _sample_inputs(logits, state, arrays, rows, mesh)
    return inputs, kv_cache, state, carry


def _lone_pass(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array,
               fbuf: jax.Array, *, layout: PackedLayout, cfg: LlamaConfig, attention_impl: str,
               mesh: jax.sharding.Mesh, rows: int):
    """A batch alone in an empty pipeline through every stage at once
    (``sharding.pipeline.lone_pass``; ``ibuf``/``fbuf``: its own packed step, fed like the
    plain step's), then ``_tick``'s tail on the stream that left the last stage."""
    ibuf = layout.feed(ibuf, state.last_tokens)
    arrays = layout.unpack(ibuf, fbuf)
    kv_cache, x = pipeline.lone_pass(params, kv_cache, ibuf, fbuf, unpack=layout.unpack,
                                     mesh=mesh, cfg=cfg, attention_impl=attention_impl)
    logits = final_logits(params, x, arrays.batch.logits_rows, cfg)
    inputs, state = _sample_inputs(logits, state, arrays, rows, mesh)
    return inputs, kv_cache, state


def _unstacked(params: Params, mesh: jax.sharding.Mesh | None) -> Params:
    """``unstack_layers`` on placed params, each layer's arrays keeping their tp split; with
    spp > 1 ``pipeline.unstack_stages`` (each stage's layers, still split by stage)."""
    split = (unstack_layers if mesh is None or mesh.shape["spp"] == 1 else
             functools.partial(pipeline.unstack_stages, spp=mesh.shape["spp"]))
    target = jax.eval_shape(split, params)  # structure only
    shardings = (None if mesh is None else jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec), param_specs(target),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    return jax.jit(split, out_shardings=shardings)(params)


def _programs(spp: int):
    """The runner's jitted step (spp > 1: tick), pass (spp > 1: a batch alone in an empty
    pipeline through every stage; else None), decode burst (spp == 1; else None) and
    sampler. Fresh function objects per runner:
    JAX's trace and compile caches are keyed weakly on the function, so a dropped engine's
    executables (hundreds of memory maps each on CPU) are freed with it instead of
    accumulating for the life of the process."""
    static = ("layout", "cfg", "attention_impl", "mesh", "rows")
    if spp > 1:
        step = jax.jit(_fresh(_tick), static_argnames=static + ("decode_rows",),
                       donate_argnums=(1, 2, 3))
        lone = jax.jit(_fresh(_lone_pass), static_argnames=static, donate_argnums=(1, 2))
        burst_step = None
    else:
        step = jax.jit(_fresh(_step), static_argnames=static + ("capture_layer", "slice_layers"),
                       donate_argnums=(1, 2))
        lone = None
        burst_step = jax.jit(_fresh(_burst), static_argnames=static + (
            "slice_layers", "steps", "num_decodes", "page_size"), donate_argnums=(1, 2))
    return step, lone, burst_step, jax.jit(_fresh(_sample), donate_argnums=(0,))


def _fresh(fn):
    """A new function object running ``fn`` (see ``ModelRunner.__init__``)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return fn(*args, **kwargs)
    return run


def _spec(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _sampling_spec(s: int, vocab_size: int, sharding=None) -> SamplingBatch:
    f32, i32 = jnp.float32, jnp.int32
    spec = lambda shape, dtype: _spec(shape, dtype, sharding)
    return SamplingBatch(
        temperature=spec((s,), f32), top_k=spec((s,), i32), top_p=spec((s,), f32),
        min_p=spec((s,), f32), repetition_penalty=spec((s,), f32),
        presence_penalty=spec((s,), f32), frequency_penalty=spec((s,), f32),
        seed=spec((s,), jnp.uint32), step=spec((s,), i32),
        banned_ids=spec((s, MAX_BANNED_IDS), i32),
        allowed=spec((s, mask_words(vocab_size)), i32), draft=spec((s,), i32))


def state_spec(cfg: LlamaConfig, rows: int, sharding=None) -> SeqState:
    """The abstract penalty state of ``rows`` rows (``ModelRunner(abstract=True)``)."""
    return SeqState(_spec((rows, cfg.vocab_size), jnp.int32, sharding),
                    _spec((rows, cfg.vocab_size), jnp.bool_, sharding),
                    _spec((rows,), jnp.int32, sharding))


def _padded_page_ids(pages: Sequence[int]) -> np.ndarray:
    """Page ids padded to a power of two with the reserved sink page 0, so swapping compiles
    one gather and one scatter per size class."""
    ids = np.zeros(1 << max(len(pages) - 1, 0).bit_length(), np.int32)
    ids[:len(pages)] = pages
    return ids


# Swapping moves pages as stored (quantized pages with their scales: every leaf of the
# cache has the page axis third).
@jax.jit
def _gather_pages(kv_cache: KVCache, ids: jax.Array) -> KVCache:
    return jax.tree.map(lambda pages: pages[:, :, ids], kv_cache)


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(kv_cache: KVCache, ids: jax.Array, data: KVCache) -> KVCache:
    return jax.tree.map(lambda pages, new: pages.at[:, :, ids].set(new), kv_cache, data)


def runtime_params(cfg: LlamaConfig, params: Params, mesh: jax.sharding.Mesh | None, *,
                   placed: bool, unroll: bool) -> Params:
    """``params`` as the step takes them: the runtime layout (``prepare_params``) split
    for tp on ``mesh`` unless ``placed`` already, with per-layer arrays if ``unroll``."""
    if not placed:
        params = prepare_params(params)
        if mesh is not None:
            params = shard_params(params, cfg, mesh)
    return _unstacked(params, mesh) if unroll else params


def new_state(cfg: LlamaConfig, rows: int, sharding=None) -> SeqState:
    """The zeroed penalty state of ``rows`` rows."""
    return jax.device_put(SeqState(jnp.zeros((rows, cfg.vocab_size), jnp.int32),
                                   jnp.zeros((rows, cfg.vocab_size), bool),
                                   jnp.zeros((rows,), jnp.int32)), sharding)


def abstract_of(tree):
    """``tree``'s arrays (or specs) as ``ShapeDtypeStruct``s with their shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=getattr(x, "sharding", None)),
                        tree)


def _check_capture_layer(cfg: LlamaConfig, layer: int | None, mesh) -> None:
    if layer is None:
        return
    if mesh is not None:
        raise ValueError("capturing a layer's hidden state (length probe) runs on one "
                         "device only, not with a tensor-parallel mesh")
    if not 0 <= layer < cfg.num_hidden_layers:
        raise ValueError(f"capture layer must be in [0, {cfg.num_hidden_layers}), "
                         f"got {layer}")


class ModelRunner:
    """Holds the device state and runs steps. With a ``mesh`` the params are split for tensor
    parallelism (``sharding.specs``) and ``kv_cache`` must come from
    ``allocate_sharded_kv_cache`` on it; the step's inputs, penalty state and sampling are
    replicated. With ``spp > 1`` on the mesh each step is a pipeline tick
    (``sharding.pipeline``): params and pages are split by stage, swapping is unsupported."""

    def __init__(self, cfg: LlamaConfig, params: Params, kv_cache: KVCache, buckets: Buckets,
                 max_num_seqs: int, attention_impl: str, mesh: jax.sharding.Mesh | None = None,
                 capture_layer: int | None = None, params_placed: bool = False,
                 abstract: bool = False, unroll_layers: bool = False,
                 slice_layers: bool = False):
        """``params_placed``: ``params`` are already in the runtime layout, tp-laid-out and
        placed on ``mesh`` (a loader that streams them there, ``jserve.model.weights``).
        ``abstract``: ``params`` (runtime layout, placed) and ``kv_cache`` are
        ``jax.ShapeDtypeStruct``s and so is the penalty state: the runner only lowers and
        compiles (``compiled``, ``sampler``), nothing is allocated (``jserve.engine.memory_plan``).
        ``unroll_layers``: run the layers unrolled over separate per-layer weight arrays
        instead of one loop over stacked ones (``jserve.model.llama.unstack_layers``; with
        spp each stage's own layers, ``sharding.pipeline.unstack_stages``). ``slice_layers``
        (spp == 1): stacked params, the layers unrolled in the program over static slices of
        them (``EngineConfig.layer_loop`` "sliced")."""
        params_placed = params_placed or abstract
        _check_capture_layer(cfg, capture_layer, mesh)
        self.capture_layer = capture_layer
        self.last_capture = None  # the latest step's Capture (device arrays) when capturing
        self.cfg = cfg
        self.mesh = mesh
        self._replicated = (None if mesh is None else
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        # Stream pipeline: every call of the step is one tick; ``start_pipeline`` fills the
        # carry. Params and pages are split by stage on the mesh's "spp" axis either way.
        self.spp = mesh.shape["spp"] if mesh is not None else 1
        self.carry: pipeline.PipelineCarry | None = None
        self.params = params if abstract else runtime_params(
            cfg, params, mesh, placed=params_placed, unroll=unroll_layers)
        self.kv_cache = kv_cache
        self.buckets = buckets
        rows = max_num_seqs + buckets.prefill_rows + 1
        self.state = (state_spec(cfg, rows, self._replicated) if abstract
                      else new_state(cfg, rows, self._replicated))
        self.state_sink = rows - 1
        self.attention_impl = attention_impl
        self.slice_layers = slice_layers
        self.sample_rows = buckets.max_rows
        # Speculative decoding widens the decode buckets (1 + k rows a decode); steps within
        # the rows of plain decoding keep a sampler of that size (``rows_for``), so they pay
        # nothing for the option. Without drafts both sizes are the same.
        self._plain_rows = min(max_num_seqs + buckets.prefill_rows, buckets.max_rows)
        self._plain_sampler: jax.stages.Compiled | None = None
        self._jitted, self._pass_jit, self._burst_jit, self._sample_jit = _programs(self.spp)
        self._compiled: dict[tuple[int, int], tuple[jax.stages.Compiled, PackedLayout]] = {}
        self._passes: dict[tuple[int, int], tuple[jax.stages.Compiled, PackedLayout]] = {}
        self._bursts: dict[_BurstKey, jax.stages.Compiled] = {}
        self.page_size = jax.tree.leaves(kv_cache)[0].shape[3]
        self._sampler: jax.stages.Compiled | None = None
        self.compile_count = 0
        self.executed: collections.Counter = collections.Counter()  # steps run per shape
        self.passed: collections.Counter = collections.Counter()  # lone passes per shape
        self.compile_seconds = 0.0  # wall time spent lowering and compiling
        self.compiled_up_front = 0  # programs compiled by ``warmup`` (before the engine is ready)
        self.cache_events: collections.Counter = collections.Counter()  # cache_hits/_misses
        self.deferred: DeferredCompiles | None = None  # after ``defer()``
        self.padded: collections.Counter = collections.Counter()  # (needed, ran as) -> steps
        self._lock = threading.Lock()  # _compiled and the counters, shared with that thread
        self._arg_specs = None  # abstract (params, KV, state): lowering never reads arrays

    @property
    def stream_shape(self) -> tuple[int, int]:
        """The pipeline carry's canonical rows (``sharding.pipeline``): the most decode rows
        of any bucket, then the largest prefill chunk."""
        b = self.buckets
        return max(b.decode_rows + b.decode_only_rows), b.prefill_tokens[-1]

    def arrays_spec(self, num_decodes: int, num_prefill_tokens: int) -> StepArrays:
        """Abstract shapes of a bucket's inputs (what ``StepBuilder`` fills)."""
        t = num_decodes + num_prefill_tokens
        s = num_decodes + (self.buckets.prefill_rows if num_prefill_tokens else 0)
        i32 = jnp.int32
        attn = AttentionMetadata(
            positions=_spec((t,), i32), token_seq=_spec((t,), i32), kv_lens=_spec((s,), i32),
            page_table=_spec((s, self.buckets.page_table_width), i32),
            num_prefills=_spec((), i32), num_decodes=num_decodes)
        sampling = _sampling_spec(s, self.cfg.vocab_size)
        return StepArrays(
            batch=StepInput(tokens=_spec((t,), i32), slots=_spec((t,), i32),
                            logits_rows=_spec((s,), i32), attn=attn,
                            slot_groups=_spec((t,), i32), start_groups=_spec((s,), i32)),
            token_state_rows=_spec((t,), i32), token_is_prompt=_spec((t,), bool),
            token_fed=_spec((t,), bool), state_rows=_spec((s,), i32),
            reset_rows=_spec((s,), i32), sampled_state_rows=_spec((s,), i32),
            sampling=sampling,
            any_random=_spec((), bool), any_penalty=_spec((), bool),
            want_logprobs=_spec((), bool))

    def _buffer_specs(self, shape: tuple[int, int], lone: bool = False
                      ) -> tuple[PackedLayout, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """A bucket's layout and its packed int32 and float32 buffers, abstract."""
        layout = PackedLayout(self.arrays_spec(*shape))
        ishape, fshape = self._buffer_shapes(layout, lone)
        return (layout, jax.ShapeDtypeStruct(ishape, jnp.int32, sharding=self._replicated),
                jax.ShapeDtypeStruct(fshape, jnp.float32, sharding=self._replicated))

    def _lower(self, shape: tuple[int, int], lone: bool = False
               ) -> tuple[jax.stages.Lowered, PackedLayout]:
        layout, ibuf, fbuf = self._buffer_specs(shape, lone)
        if lone:
            return self._pass_jit.lower(
                *self._specs(), ibuf, fbuf, layout=layout,
                cfg=self.cfg, attention_impl=self.attention_impl, mesh=self.mesh,
                rows=self.rows_for(shape)), layout
        carry = () if self.spp == 1 else (pipeline.carry_spec(
            self.mesh, self.cfg, sum(self.stream_shape)),)
        lowered = self._jitted.lower(*self._specs(), *carry, ibuf, fbuf,
                                     layout=layout, cfg=self.cfg,
                                     attention_impl=self.attention_impl, mesh=self.mesh,
                                     rows=self.rows_for(shape),
                                     **({"decode_rows": self.stream_shape[0]} if self.spp > 1
                                        else {"capture_layer": self.capture_layer,
                                              "slice_layers": self.slice_layers}))
        return lowered, layout

    def _lower_burst(self, key: _BurstKey) -> jax.stages.Lowered:
        layout, ibuf, fbuf = self._buffer_specs(key.shape)
        return self._burst_jit.lower(
            *self._specs(), ibuf, fbuf,
            layout=layout, cfg=self.cfg, attention_impl=self.attention_impl, mesh=self.mesh,
            rows=self.rows_for(key.shape), slice_layers=self.slice_layers, steps=key.steps,
            num_decodes=key.shape[0], page_size=self.page_size)

    def burst_ready(self, shape: tuple[int, int], steps: int) -> bool:
        """Whether a burst of ``steps`` decode steps of the all-decode ``shape`` can run now
        (spp == 1): its program and the shape's step are compiled. If not, with background
        compiles (``defer``) the burst's is queued and the caller steps one at a time
        meanwhile; without, it compiles now."""
        key = _BurstKey(shape, steps)
        if key in self._bursts and shape in self._compiled:
            return True
        if self.deferred is not None:
            self.deferred.request(key)
            return False
        self._compile_burst(key)
        self.compiled(shape)
        return True

    def _compile_burst(self, key: _BurstKey) -> None:
        t0 = time.perf_counter()
        self._keep(self._bursts, key, _compile(self._lower_burst(key), self.cache_events), t0)

    def _keep(self, cache: dict, key, program, t0: float) -> None:
        """Stores a program compiled since ``t0`` unless another thread stored one first,
        and counts it."""
        with self._lock:
            if key not in cache:
                cache[key] = program
                self.compile_count += 1
                self.compile_seconds += time.perf_counter() - t0

    def _buffer_shapes(self, layout: PackedLayout, lone: bool = False
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        lead = (self.spp,) if self.spp > 1 and not lone else ()
        return lead + (layout.int_size,), lead + (layout.float_size,)

    def buffer_shapes(self, shape: tuple[int, int], lone: bool = False
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The packed int32 and float32 buffers a step of ``shape`` takes: one step's, or with
        spp > 1 one per pipeline slot ([spp, size]) unless ``lone`` (a pass: one step's)."""
        return self._buffer_shapes(self.compiled(shape, lone)[1], lone)

    def rows_for(self, shape: tuple[int, int]) -> int:
        """The rows a step of ``shape`` pads its sampling inputs to."""
        rows = shape[0] + (self.buckets.prefill_rows if shape[1] else 0)
        return self._plain_rows if self.spp == 1 and rows <= self._plain_rows \
            else self.sample_rows

    def _lower_sampler(self, rows: int | None = None) -> jax.stages.Lowered:
        """The sampling program, on the padded rows every step hands it (the largest step's
        unless ``rows``)."""
        r, rep = rows or self.sample_rows, self._replicated
        b = lambda: _spec((), bool, rep)
        spec = SampleInputs(logits=_spec((r, self.cfg.vocab_size), jnp.float32, rep),
                            state_rows=_spec((r,), jnp.int32, rep),
                            sampled_state_rows=_spec((r,), jnp.int32, rep),
                            sampling=_sampling_spec(r, self.cfg.vocab_size, rep),
                            any_random=b(), any_penalty=b(),
                            want_logprobs=b())
        return self._sample_jit.lower(self._specs()[2], spec)

    def _specs(self) -> tuple:
        """(params, KV cache, state) as ``ShapeDtypeStruct``s with their shardings, taken once
        (the arrays are donated every step; a background lowering must not touch them)."""
        with self._lock:
            return self._specs_unlocked()

    def attach(self, params: Params, kv_cache: KVCache) -> bool:
        """The real weights (the step's layout, placed) and KV pages of a runner built on
        their specs (``abstract=True``, so its programs compiled while they loaded), and a
        new penalty state. False when they differ from the specs in a way the programs
        see: then the programs are dropped, to compile again."""
        def signature(tree):
            return (jax.tree.structure(tree),
                    [(x.shape, np.dtype(x.dtype), x.sharding) for x in jax.tree.leaves(tree)])
        with self._lock:
            same = (signature(abstract_of((params, kv_cache)))
                    == signature(self._specs_unlocked()[:2]))
            self.params, self.kv_cache = params, kv_cache
            self.state = new_state(self.cfg, self.state_sink + 1, self._replicated)
            if not same:
                log.warning("loaded weights or KV pages differ from the specs the programs "
                            "were compiled for; compiling again")
                self._arg_specs = None
                self._compiled.clear()
                self._bursts.clear()
                self._sampler = self._plain_sampler = None
        return same

    def _specs_unlocked(self) -> tuple:
        if self._arg_specs is None:
            self._arg_specs = abstract_of((self.params, self.kv_cache, self.state))
        return self._arg_specs

    def pass_warmup_shapes(self) -> list[tuple[int, int]]:
        """The shapes whose pass ``warmup`` compiles (spp > 1): the decode-only ones, where a
        lone batch's pass sets the time between tokens. Other shapes' passes (a lone
        prefill) compile on first use, at most one per bucket shape."""
        return [] if self.spp == 1 else [s for s in self.buckets.all_shapes() if s[1] == 0]

    def compiled(self, shape: tuple[int, int], lone: bool = False
                 ) -> tuple[jax.stages.Compiled, PackedLayout]:
        """The step (spp: tick) executable of ``shape`` and its layout, compiled on first use
        (a shape the background thread has in hand: waits for it); ``lone``: the pass
        executable instead (spp > 1)."""
        cache = self._passes if lone else self._compiled
        entry = cache.get(shape)
        if entry is None and not lone and self.deferred is not None:
            fut = self.deferred.future(shape)
            if fut is not None and not fut.cancelled():
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - compiled below, in this thread
                    pass
                entry = cache.get(shape)
        if entry is None:
            t0 = time.perf_counter()
            lowered, layout = self._lower(shape, lone)
            exe = _compile(lowered, self.cache_events)
            with self._lock:
                entry = cache.setdefault(shape, (exe, layout))
                self.compile_count += 1
                self.compile_seconds += time.perf_counter() - t0
        return entry

    def core_shapes(self) -> list[tuple[int, int]]:
        """What ``warmup(core=True)`` compiles before the engine is ready: the largest step,
        which every other step fits in padded, and the smallest decode-only step (one
        stream decoding: the common steady state, where padding would cost the most)."""
        b = self.buckets
        largest = (b.decode_rows[-1], b.prefill_tokens[-1])
        smallest_decode = b.shape_for(1, 0)
        return [smallest_decode, largest] if smallest_decode != largest else [largest]

    def defer(self, compile_rest: bool = False) -> None:
        """From now on a step shape not compiled yet runs padded up (``ready_shape``) while
        it compiles in the background; ``compile_rest``: queue every bucket shape not
        compiled yet now, smallest first. The sampling executable (spp == 1: only a step
        whose masks come late runs it) is queued first, unless compiled already."""
        self.deferred = DeferredCompiles(self._compile_in_background)
        for rows in self._sampler_rows():
            if self._sampler_for(rows) is None:
                self.deferred.request(_SamplerKey(rows))
        if compile_rest:
            for shape in sorted(self.deferred_shapes(), key=lambda s: (s[0] + s[1], s)):
                self.deferred.request(shape)

    def deferred_shapes(self) -> list[tuple[int, int]]:
        """Bucket shapes whose step is not compiled (yet)."""
        with self._lock:
            return [s for s in self.buckets.all_shapes() if s not in self._compiled]

    def _compile_in_background(self, shape: "tuple[int, int] | _SamplerKey") -> None:
        if isinstance(shape, _SamplerKey):
            self.sampler(shape.rows, wait=False)
            return
        if isinstance(shape, _BurstKey):
            self._compile_burst(shape)
            self.deferred.request(shape.shape)  # its step too, if not compiled yet
            return
        t0 = time.perf_counter()
        lowered, layout = self._lower(shape)
        self._keep(self._compiled, shape, (_compile(lowered, self.cache_events), layout), t0)

    def ready_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The shape to run a step of bucket ``shape`` at now: itself once compiled; while
        it is not (``defer``), the smallest compiled shape at least as large in both
        dimensions, and its compile is queued; with none, itself (compiled on the spot)."""
        if self.deferred is None or shape in self._compiled:
            return shape
        with self._lock:
            cover = [s for s in self._compiled if s[0] >= shape[0] and s[1] >= shape[1]]
        if not cover:
            return shape
        self.deferred.request(shape)
        ran = min(cover, key=lambda s: (s[0] + s[1], s))
        self.padded[(shape, ran)] += 1
        return ran

    @property
    def compiled_later(self) -> int:
        """Programs compiled after ``warmup``: in the background or on first use."""
        return self.compile_count - self.compiled_up_front

    def wait_compiles(self, timeout: float | None = None) -> bool:
        """Blocks until the background compiles requested so far are done (tests, benches)."""
        return self.deferred is None or self.deferred.wait(timeout)

    def _sampler_rows(self) -> list[int]:
        """The row counts of the sampling executables steps use (``rows_for``)."""
        return list(dict.fromkeys((self.sample_rows, self._plain_rows)))

    def samplers_missing(self) -> int:
        """Sampling executables not compiled (yet): ``defer`` queues them."""
        return sum(self._sampler_for(rows) is None for rows in self._sampler_rows())

    def _sampler_for(self, rows: int) -> jax.stages.Compiled | None:
        return self._plain_sampler if rows != self.sample_rows else self._sampler

    def sampler(self, rows: int | None = None, wait: bool = True) -> jax.stages.Compiled:
        """The sampling executable on ``rows`` padded rows (default: the largest step's),
        compiled on first use; ``wait``: if the background thread has it in hand, wait for
        it rather than compile it a second time."""
        rows = rows or self.sample_rows
        plain = rows != self.sample_rows
        if self._sampler_for(rows) is None and wait and self.deferred is not None:
            fut = self.deferred.future(_SamplerKey(rows))
            if fut is not None and not fut.cancelled():
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 - compiled below, in this thread
                    pass
        with self._lock:
            exe = self._sampler_for(rows)
        if exe is None:
            t0 = time.perf_counter()
            exe = _compile(self._lower_sampler(rows if plain else None), self.cache_events)
            with self._lock:
                if self._sampler_for(rows) is not None:  # the other thread was first
                    return self._sampler_for(rows)
                if plain:
                    self._plain_sampler = exe
                else:
                    self._sampler = exe
                self.compile_count += 1
                self.compile_seconds += time.perf_counter() - t0
        return exe

    def warmup(self, threads: int | None = None, progress: bool | None = None,
               core: bool = False) -> None:
        """Compiles every bucket's step (spp: tick), or with ``core`` only ``core_shapes``,
        the sampler (not with ``core`` when spp == 1: ``defer`` queues it) and, under spp,
        the decode-only shapes' passes (``pass_warmup_shapes``).
        Tracing and lowering run here one after another (the layer loop keeps them cheap at
        any depth); XLA compiles, or reads the persistent cache, in ``threads`` worker
        threads (default: one per two cores, at least 2), which release the GIL.
        ``progress``: a tqdm bar (None: only on a terminal)."""
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        shapes = self.core_shapes() if core else self.buckets.all_shapes()
        # A plain step samples in its own executable; the sampling executable serves only
        # steps whose masks come late, so with ``core`` it compiles after start (``defer``).
        samplers = self.spp > 1 or not core
        todo = [(s, False) for s in shapes if s not in self._compiled]
        todo += [(s, True) for s in self.pass_warmup_shapes() if s not in self._passes]
        todo.sort(key=lambda job: -sum(job[0]))  # the longest compiles start first
        jobs: dict = {}
        threads = threads or max(2, (os.cpu_count() or 2) // 2)
        with ThreadPoolExecutor(threads) as pool, \
                tqdm(total=len(todo) + (samplers and self._sampler is None),
                     desc="compiling step shapes",
                     unit="shape", disable=None if progress is None else not progress) as bar:
            for shape, lone in todo:
                lowered, layout = self._lower(shape, lone)
                jobs[pool.submit(_compile, lowered, self.cache_events)] = (shape, layout, lone)
            if samplers and self._sampler is None:
                jobs[pool.submit(_compile, self._lower_sampler(), self.cache_events)] = (None, None,
                                                                         False)
            if samplers and self._plain_rows != self.sample_rows and self._plain_sampler is None:
                self.sampler(self._plain_rows)
            for fut in as_completed(jobs):
                shape, layout, lone = jobs[fut]
                with self._lock:
                    if shape is None:
                        self._sampler = fut.result()
                    else:
                        (self._passes if lone else self._compiled)[shape] = (fut.result(),
                                                                             layout)
                    self.compile_count += 1
                bar.update()
        self.compile_seconds += time.perf_counter() - t0
        self.compiled_up_front = self.compile_count
        log.info("compiled %d step shapes%s in %.1fs (%d threads)", len(todo),
                 " and the sampler" if samplers else "", time.perf_counter() - t0, threads)

    # -- swapping KV pages to host memory and back ---------------------------------------
    def read_pages(self, pages: Sequence[int]):
        """Host copies (k, v) of ``pages`` in every layer ([layers, Hkv, len(pages), S, D]),
        as stored (quantized pages: values and scales)."""
        ids = _padded_page_ids(pages)
        data = jax.device_get(_gather_pages(self.kv_cache, ids))
        return jax.tree.map(lambda x: x[:, :, :len(pages)], data)

    def write_pages(self, pages: Sequence[int], data) -> None:
        ids = _padded_page_ids(pages)
        widths = ((0, 0), (0, 0), (0, len(ids) - len(pages)), (0, 0), (0, 0))
        data = jax.tree.map(lambda x: np.pad(x, widths), data)
        self.kv_cache = _scatter_pages(self.kv_cache, ids, data)

    def execute(self, shape: tuple[int, int], arrays: StepArrays) -> SampleResult:
        """One unpipelined step (spp == 1) of ``arrays``."""
        return self.execute_packed(shape, *self.compiled(shape)[1].pack(arrays))

    def _execute_burst(self, shape: tuple[int, int], ibuf, fbuf, steps: int) -> SampleResult:
        exe = self._bursts[_BurstKey(shape, steps)]
        self.executed[shape] += steps
        tokens, self.kv_cache, self.state = exe(self.params, self.kv_cache, self.state, ibuf,
                                                fbuf)
        return SampleResult(tokens, None, None, None)

    def execute_packed(self, shape: tuple[int, int], ibuf, fbuf, sample: bool = True,
                       lone: bool = False, defer: bool = False, burst: int = 1
                       ) -> SampleResult | SampleInputs:
        """The step on already packed buffers (what multi-process followers receive); with
        spp > 1 one pipeline tick, ``ibuf``/``fbuf`` [spp, size] (``buffer_shapes``): row
        ``s`` the batch stage ``s`` runs, the result the last row's samples. ``sample``
        False (an empty slot leaves the pipeline): no sampling, and the result is host
        zeros, so the caller does not wait for the tick. ``lone`` (spp > 1, the pipeline
        empty): one batch's buffers [size] through every stage in one pass; the carry is
        left as it is. ``defer``: the forward only; the result is its ``SampleInputs``, which
        the caller hands to ``sample`` (with the masks it could not know at launch). One
        executable call when spp == 1 (the step samples too), two under spp > 1 (the tick
        or pass, then the sampling executable). ``burst`` > 1 (spp == 1, an all-decode step,
        ``burst_ready`` said yes): that many decode steps in one call; the result's
        ``tokens`` are [burst, rows], its logprobs fields None (bursts carry none)."""
        if burst > 1:
            return self._execute_burst(shape, ibuf, fbuf, burst)
        exe, _ = self.compiled(shape, lone)
        (self.passed if lone else self.executed)[shape] += 1
        if lone:
            inputs, self.kv_cache, self.state = exe(self.params, self.kv_cache, self.state,
                                                    ibuf, fbuf)
        elif self.spp > 1:
            inputs, self.kv_cache, self.state, self.carry = exe(
                self.params, self.kv_cache, self.state, self.carry, ibuf, fbuf)
        else:  # the step samples too (``_step``)
            out, inputs, self.kv_cache, self.state, *capture = exe(
                self.params, self.kv_cache, self.state, ibuf, fbuf)
            if capture:
                self.last_capture = capture[0]
            return inputs if defer else out
        if not sample:
            return self._nothing_sampled()
        return inputs if defer else self.sample(inputs)

    def sample(self, inputs: SampleInputs, allowed: np.ndarray | None = None) -> SampleResult:
        """The sampling executable on a forward's ``inputs``; ``allowed``: the bitmask of
        every padded row [rows, words] in place of the one the step was built with (rows:
        ``rows_for`` the step's shape)."""
        if allowed is not None:
            sb = inputs.sampling
            inputs = dataclasses.replace(inputs, sampling=dataclasses.replace(
                sb, allowed=allowed))  # the executable's own transfer: the cheapest
        out, self.state = self.sampler(inputs.logits.shape[0])(self.state, inputs)
        return out

    def _nothing_sampled(self) -> SampleResult:
        r, n = self.sample_rows, MAX_LOGPROBS
        return SampleResult(np.zeros(r, np.int32), np.zeros(r, np.float32),
                            np.zeros((r, n), np.int32), np.zeros((r, n), np.float32))

    def start_pipeline(self) -> None:
        """A zero residual stream in every pipeline slot (the slots' steps come with each
        tick)."""
        self.carry = pipeline.empty_carry(self.mesh, self.cfg, sum(self.stream_shape))

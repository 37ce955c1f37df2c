"""The device side of the engine: one fused jitted step (forward, penalty state, sampling)
compiled ahead of time per bucket, with a compile counter tests read."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jserve.cache.pool import KVCache
from jserve.config import LlamaConfig
from jserve.engine.buckets import Buckets
from jserve.kernels import AttentionMetadata
from jserve.model.llama import Params, StepInput, final_logits, forward, prepare_params
from jserve.sampling.params import MAX_BANNED_IDS, MAX_LOGPROBS
from jserve.sampling.sampler import (SampleResult, SamplingBatch, apply_penalties,
                                     choose_tokens, token_logprobs)
from sharding import pipeline
from sharding.specs import shard_params
from sharding.tensor_parallel import tp_forward

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SeqState:
    """Per-sequence device state for penalties: generated-token counts and prompt membership.

    Rows are handed to running sequences; a row is reset when its sequence's first chunk
    (position 0) runs, and filled from the tokens the forward pass consumes, so recompute after
    preemption rebuilds it exactly. The last row is a sink for padding.
    """

    output_counts: jax.Array  # [R, V] int32
    prompt_mask: jax.Array    # [R, V] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Everything one step sends to the device (see ``StepBuilder``)."""

    batch: StepInput
    token_state_rows: jax.Array  # [T]
    token_is_prompt: jax.Array   # [T]
    state_rows: jax.Array        # [S]
    reset_rows: jax.Array        # [S]
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
    return SeqState(counts, mask)


class PackedLayout:
    """Where each leaf of a bucket's ``StepArrays`` sits in two flat buffers (int32, float32).

    One host-to-device copy per buffer instead of one per leaf: with ~25 small leaves the
    per-transfer cost was over a tenth of a decode step on CPU. Bools travel as int32, uint32
    seeds as their int32 bit pattern.
    """

    def __init__(self, spec: StepArrays):
        leaves, self.treedef = jax.tree.flatten(spec)
        self.fields: list[tuple[np.dtype, tuple[int, ...], bool, int]] = []
        sizes = [0, 0]
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            is_float = dtype == np.float32
            n = int(np.prod(leaf.shape))
            self.fields.append((dtype, tuple(leaf.shape), is_float, sizes[is_float]))
            sizes[is_float] += n
        self.int_size, self.float_size = sizes

    def pack(self, arrays: StepArrays) -> tuple[np.ndarray, np.ndarray]:
        ints, floats = [], []
        for (dtype, _, is_float, _), leaf in zip(self.fields, jax.tree.leaves(arrays)):
            flat = np.asarray(leaf, dtype).ravel()
            if is_float:
                floats.append(flat)
            else:
                ints.append(flat.view(np.int32) if dtype == np.uint32 else flat.astype(np.int32))
        return np.concatenate(ints), np.concatenate(floats)

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


def _sample(logits: jax.Array, state: SeqState, arrays: StepArrays
            ) -> tuple[SampleResult, SeqState]:
    """The step's tail after the forward: penalty state, sampling and logprobs (shared by the
    plain step and the pipeline tick)."""
    sb = arrays.sampling
    # Runtime choices (no recompile): penalty bookkeeping only when some row uses penalties
    # (a row is reset at its sequence's first chunk, so skipped steps leave nothing stale
    # that a penalised request reads), the sort only when some row samples, top-n logprobs
    # only when asked.
    state = jax.lax.cond(
        arrays.any_penalty,
        lambda: _update_state(state, arrays.batch.tokens, arrays.token_state_rows,
                              arrays.token_is_prompt, arrays.reset_rows),
        lambda: state)
    penalised = jax.lax.cond(
        arrays.any_penalty,
        lambda: apply_penalties(logits, state.output_counts[arrays.state_rows],
                                state.prompt_mask[arrays.state_rows], sb),
        lambda: logits)
    tokens = jax.lax.cond(arrays.any_random,
                          lambda: choose_tokens(penalised, sb, all_greedy=False),
                          lambda: choose_tokens(penalised, sb, all_greedy=True))
    s = logits.shape[0]
    chosen, top_ids, top_lp = jax.lax.cond(
        arrays.want_logprobs,
        lambda: token_logprobs(logits, tokens, MAX_LOGPROBS),
        lambda: (jnp.zeros((s,), jnp.float32), jnp.zeros((s, MAX_LOGPROBS), jnp.int32),
                 jnp.zeros((s, MAX_LOGPROBS), jnp.float32)))
    return SampleResult(tokens, chosen, top_ids, top_lp), state


def _step(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array, fbuf: jax.Array,
          *, layout: PackedLayout, cfg: LlamaConfig, attention_impl: str,
          mesh: jax.sharding.Mesh | None, capture_layer: int | None = None):
    """With ``capture_layer`` set, a fourth output: the layer's ``Capture`` (prompt sums over
    the step's prompt tokens); ``None`` compiles exactly the step without it."""
    arrays = layout.unpack(ibuf, fbuf)
    if mesh is None:
        logits, kv_cache, capture = forward(
            params, kv_cache, arrays.batch, cfg=cfg, attention_impl=attention_impl,
            capture_layer=capture_layer,
            prompt_mask=arrays.token_is_prompt if capture_layer is not None else None)
    else:  # tensor / KV-cache parallel; the rest of the step runs replicated on the logits
        logits, kv_cache = tp_forward(params, kv_cache, arrays.batch, mesh=mesh, cfg=cfg,
                                      attention_impl=attention_impl)
    out, state = _sample(logits, state, arrays)
    if capture_layer is not None:
        return out, kv_cache, state, capture
    return out, kv_cache, state


def _tick(params: Params, kv_cache: KVCache, state: SeqState, carry: pipeline.PipelineCarry,
          ibuf: jax.Array, fbuf: jax.Array, *, layout: PackedLayout, cfg: LlamaConfig,
          attention_impl: str, mesh: jax.sharding.Mesh):
    """A stream-pipeline tick (``sharding.pipeline.tick``), then the plain step's tail on the
    batch that left the last stage (replicated, outside the shard_map)."""
    kv_cache, carry = pipeline.tick(params, kv_cache, carry, ibuf, fbuf, unpack=layout.unpack,
                                    mesh=mesh, cfg=cfg, attention_impl=attention_impl)
    x, ib, fb = carry.exiting()
    arrays = layout.unpack(ib, fb)
    logits = final_logits(params, x, arrays.batch.logits_rows, cfg)
    out, state = _sample(logits, state, arrays)
    # Replicated like the plain step's outputs (multi-process leaders read their own copy;
    # the donated state keeps its input sharding).
    out, state = jax.lax.with_sharding_constraint(
        (out, state), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return out, kv_cache, state, carry


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _padded_page_ids(pages: Sequence[int]) -> np.ndarray:
    """Page ids padded to a power of two with the reserved sink page 0, so swapping compiles
    one gather and one scatter per size class."""
    ids = np.zeros(1 << max(len(pages) - 1, 0).bit_length(), np.int32)
    ids[:len(pages)] = pages
    return ids


@jax.jit
def _gather_pages(kv_cache: KVCache, ids: jax.Array) -> KVCache:
    return [(k[:, ids], v[:, ids]) for k, v in kv_cache]


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(kv_cache: KVCache, ids: jax.Array, data: KVCache) -> KVCache:
    return [(k.at[:, ids].set(dk), v.at[:, ids].set(dv)) for (k, v), (dk, dv) in zip(kv_cache, data)]


class ModelRunner:
    """Holds the device state and runs steps. With a ``mesh`` the params are split for tensor
    parallelism (``sharding.specs``) and ``kv_cache`` must come from
    ``allocate_sharded_kv_cache`` on it; the step's inputs, penalty state and sampling are
    replicated. With ``spp > 1`` on the mesh each step is a pipeline tick
    (``sharding.pipeline``): params and pages are split by stage, swapping is unsupported."""

    def __init__(self, cfg: LlamaConfig, params: Params, kv_cache: KVCache, buckets: Buckets,
                 max_num_seqs: int, attention_impl: str, mesh: jax.sharding.Mesh | None = None,
                 capture_layer: int | None = None):
        if capture_layer is not None:
            if mesh is not None:
                raise ValueError("capturing a layer's hidden state (length probe) runs on one "
                                 "device only, not with a tensor-parallel mesh")
            if not 0 <= capture_layer < cfg.num_hidden_layers:
                raise ValueError(f"capture layer must be in [0, {cfg.num_hidden_layers}), "
                                 f"got {capture_layer}")
        self.capture_layer = capture_layer
        self.last_capture = None  # the latest step's Capture (device arrays) when capturing
        self.cfg = cfg
        self.mesh = mesh
        self.params = prepare_params(params)
        self._replicated = None
        # Stream pipeline: every call of the step is one tick; ``kv_cache`` must come from
        # ``pipeline.allocate_pipeline_kv_cache`` and ``start_pipeline`` fill the carry.
        self.spp = mesh.shape["spp"] if mesh is not None else 1
        self.carry: pipeline.PipelineCarry | None = None
        if self.spp > 1:
            self.params = pipeline.shard_stage_params(self.params, cfg, mesh)
        elif mesh is not None:
            self.params = shard_params(self.params, cfg, mesh)
        if mesh is not None:
            self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.kv_cache = kv_cache
        self.buckets = buckets
        rows = max_num_seqs + buckets.prefill_rows + 1
        self.state = jax.device_put(SeqState(jnp.zeros((rows, cfg.vocab_size), jnp.int32),
                                             jnp.zeros((rows, cfg.vocab_size), bool)),
                                    self._replicated)
        self.state_sink = rows - 1
        self.attention_impl = attention_impl
        self._jitted = (
            jax.jit(_tick, static_argnames=("layout", "cfg", "attention_impl", "mesh"),
                    donate_argnums=(1, 2, 3)) if self.spp > 1 else
            jax.jit(_step, static_argnames=("layout", "cfg", "attention_impl", "mesh",
                                            "capture_layer"),
                    donate_argnums=(1, 2)))
        self._compiled: dict[tuple[int, int], tuple[jax.stages.Compiled, PackedLayout]] = {}
        self.compile_count = 0

    def arrays_spec(self, num_decodes: int, num_prefill_tokens: int) -> StepArrays:
        """Abstract shapes of a bucket's inputs (what ``StepBuilder`` fills)."""
        t = num_decodes + num_prefill_tokens
        s = num_decodes + (self.buckets.prefill_rows if num_prefill_tokens else 0)
        i32 = jnp.int32
        attn = AttentionMetadata(
            positions=_spec((t,), i32), token_seq=_spec((t,), i32), kv_lens=_spec((s,), i32),
            page_table=_spec((s, self.buckets.page_table_width), i32),
            num_prefills=_spec((), i32), num_decodes=num_decodes)
        f32 = jnp.float32
        sampling = SamplingBatch(
            temperature=_spec((s,), f32), top_k=_spec((s,), i32), top_p=_spec((s,), f32),
            min_p=_spec((s,), f32), repetition_penalty=_spec((s,), f32),
            presence_penalty=_spec((s,), f32), frequency_penalty=_spec((s,), f32),
            seed=_spec((s,), jnp.uint32), step=_spec((s,), i32),
            banned_ids=_spec((s, MAX_BANNED_IDS), i32))
        return StepArrays(
            batch=StepInput(tokens=_spec((t,), i32), slots=_spec((t,), i32),
                            logits_rows=_spec((s,), i32), attn=attn,
                            slot_groups=_spec((t,), i32), start_groups=_spec((s,), i32)),
            token_state_rows=_spec((t,), i32), token_is_prompt=_spec((t,), bool),
            state_rows=_spec((s,), i32), reset_rows=_spec((s,), i32), sampling=sampling,
            any_random=_spec((), bool), any_penalty=_spec((), bool),
            want_logprobs=_spec((), bool))

    def compiled(self, shape: tuple[int, int]) -> tuple[jax.stages.Compiled, PackedLayout]:
        entry = self._compiled.get(shape)
        if entry is None:
            layout = PackedLayout(self.arrays_spec(*shape))
            ibuf = jax.ShapeDtypeStruct((layout.int_size,), jnp.int32, sharding=self._replicated)
            fbuf = jax.ShapeDtypeStruct((layout.float_size,), jnp.float32,
                                        sharding=self._replicated)
            carry = () if self.spp == 1 else (pipeline.carry_spec(
                self.mesh, self.cfg, sum(shape), layout.int_size, layout.float_size),)
            exe = self._jitted.lower(self.params, self.kv_cache, self.state, *carry, ibuf, fbuf,
                                     layout=layout, cfg=self.cfg,
                                     attention_impl=self.attention_impl, mesh=self.mesh,
                                     **({} if self.spp > 1 else
                                        {"capture_layer": self.capture_layer})).compile()
            self.compile_count += 1
            entry = self._compiled[shape] = (exe, layout)
        return entry

    def warmup(self) -> None:
        t0 = time.perf_counter()
        for shape in self.buckets.all_shapes():
            self.compiled(shape)
        log.info("warmed up %d step shapes in %.1fs", len(self._compiled), time.perf_counter() - t0)

    # -- swapping KV pages to host memory and back ---------------------------------------
    def read_pages(self, pages: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Host copies of ``pages`` of every layer ([Hkv, len(pages), S, D] each)."""
        ids = _padded_page_ids(pages)
        out = jax.device_get(_gather_pages(self.kv_cache, ids))
        return [(k[:, :len(pages)], v[:, :len(pages)]) for k, v in out]

    def write_pages(self, pages: Sequence[int], data: list[tuple[np.ndarray, np.ndarray]]) -> None:
        ids = _padded_page_ids(pages)
        pad = len(ids) - len(pages)
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        data = [(np.pad(k, widths), np.pad(v, widths)) for k, v in data]
        self.kv_cache = _scatter_pages(self.kv_cache, ids, data)

    def execute(self, shape: tuple[int, int], arrays: StepArrays) -> SampleResult:
        return self.execute_packed(shape, *self.compiled(shape)[1].pack(arrays))

    def execute_packed(self, shape: tuple[int, int], ibuf, fbuf) -> SampleResult:
        """The step on already packed buffers (what multi-process followers receive)."""
        exe, _ = self.compiled(shape)
        if self.spp > 1:
            out, self.kv_cache, self.state, self.carry = exe(
                self.params, self.kv_cache, self.state, self.carry, ibuf, fbuf)
            return out
        out, self.kv_cache, self.state, *capture = exe(self.params, self.kv_cache, self.state,
                                                        ibuf, fbuf)
        if capture:
            self.last_capture = capture[0]
        return out

    def start_pipeline(self, shape: tuple[int, int], empty: StepArrays) -> None:
        """Fill every pipeline slot with ``empty`` (an all-padding step of the tick shape)."""
        layout = self.compiled(shape)[1]
        self.carry = pipeline.empty_carry(self.mesh, self.cfg, sum(shape), *layout.pack(empty))

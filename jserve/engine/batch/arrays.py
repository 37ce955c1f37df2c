"""What one step sends to the device and keeps there: ``StepArrays`` (the bucket's inputs,
packed by ``PackedLayout`` into one int32 and one float32 buffer), the per-sequence device
state ``SeqState``, the ``SampleInputs`` the sampling executable takes, and their abstract
specs (``jax.ShapeDtypeStruct``s a program is lowered against)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jserve.config import ModelConfig
from jserve.engine.batch.buckets import Buckets
from jserve.kernels import AttentionMetadata
from jserve.model.decoder import StepInput
from jserve.sampling.params import MAX_BANNED_IDS, MAX_LOGIT_BIAS
from jserve.sampling.sampler import SamplingBatch, mask_words, pad_rows


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Everything one step sends to the device (see ``StepBuilder``)."""

    batch: StepInput
    token_state_rows: jax.Array  # [T]
    token_is_prompt: jax.Array   # [T]
    token_fed: jax.Array         # [T] bool: the token is its sequence's ``last_tokens`` entry
    # Prompt logprobs (``jserve.engine.requests.prompt_logprobs``): each token's next prompt token
    # (-1: none), whether any token has one, and the most alternatives a request wants.
    prompt_targets: jax.Array    # [T] int32
    want_prompt_logprobs: jax.Array  # scalar bool
    prompt_top: jax.Array        # scalar int32
    state_rows: jax.Array        # [S]
    reset_rows: jax.Array        # [S]
    sampled_state_rows: jax.Array  # [S] where the row's sampled token is kept (sink: nowhere)
    sampling: SamplingBatch
    any_random: jax.Array        # scalar bool: some row samples (else argmax only)
    any_penalty: jax.Array       # scalar bool: some row uses penalties (else skip their work)
    want_logprobs: jax.Array     # scalar bool
    any_bias: jax.Array          # scalar bool: some sampled row has a logit_bias
    # scalar bool: the sampling executable samples the step again, so the step hands on
    # its logits (``step_program._step``): some sampled row needs more than greedy or
    # temperature (a filter, bias, penalty, ban, mask, logprobs, a sampled draft), which
    # the fused step does not compile; or, set by ``ModelRunner.execute_packed``, masks
    # come late
    whole_chain: jax.Array
    # scalar int32: the decode steps an all-decode shape's program runs in this call, 1 or a
    # decode burst's (``BatchPlan.burst``; other shapes ignore it)
    burst: jax.Array


# The leaf of ``StepArrays`` that is not packed: the structured-output bitmask.
MASKS = ".sampling.allowed"


class PackedLayout:
    """Where each leaf of a bucket's ``StepArrays`` sits in two flat buffers (int32, float32).

    One host-to-device copy per buffer instead of one per leaf: with ~25 small leaves the
    per-transfer cost was over a tenth of a decode step on CPU. Bools travel as int32, uint32
    seeds as their int32 bit pattern. The structured-output bitmask (``MASKS``, [rows,
    vocab/32]) is not in them: it is a third array, sent only by a step where some row has
    one (None: every token allowed; the step program then reads a copy the device keeps),
    so what a step sends does not grow with the vocabulary.
    """

    def __init__(self, spec: StepArrays):
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(spec)
        self.fields: list[tuple[np.dtype, tuple[int, ...], bool, int]] = []
        # leaf path -> (offset in ints, shape) of every int leaf
        self._int_at: dict[str, tuple[int, tuple[int, ...]]] = {}
        sizes = [0, 0]
        for i, (path, leaf) in enumerate(leaves):
            if jax.tree_util.keystr(path) == MASKS:
                self.mask_at, self.mask_shape = i, tuple(leaf.shape)
                continue
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
        tokens = _fed(leaf(".token_fed") != 0, leaf(".token_state_rows"),
                      leaf(".batch.tokens"), last_tokens)
        return self.with_int_leaf(ibuf, ".batch.tokens", tokens)

    def unpack_fed(self, ibuf: jax.Array, fbuf: jax.Array, masks: jax.Array | None,
                   last_tokens: jax.Array) -> StepArrays:
        """``unpack(feed(ibuf, last_tokens), fbuf, masks)`` with only the tokens made anew:
        writing them into the buffer made XLA copy all of it every step."""
        arrays = self.unpack(ibuf, fbuf, masks)
        tokens = _fed(arrays.token_fed, arrays.token_state_rows, arrays.batch.tokens,
                      last_tokens)
        return dataclasses.replace(arrays, batch=dataclasses.replace(arrays.batch,
                                                                     tokens=tokens))

    def has_int_leaf(self, name: str) -> bool:
        return name in self._int_at

    def int_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the int leaf at path ``name``."""
        return self._int_at[name][1]

    def int_offset(self, name: str) -> int:
        """Where the int leaf at path ``name`` starts in the int32 buffer (row-major)."""
        return self._int_at[name][0]

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

    def pack(self, arrays: StepArrays, masked: bool | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The two buffers and the bitmask, or None for it when no row has one
        (``masked``: whether some row has one, if the caller knows; else it is looked
        at). ``np.concatenate`` casts as it copies (bools to int32), so a leaf is copied
        once."""
        ints, floats = [], []
        leaves = jax.tree.leaves(arrays)
        masks = np.asarray(leaves.pop(self.mask_at), np.int32)
        for (dtype, _, is_float, _), leaf in zip(self.fields, leaves, strict=True):
            flat = np.asarray(leaf, dtype).ravel()
            if is_float:
                floats.append(flat)
            else:
                ints.append(flat.view(np.int32) if dtype == np.uint32 else flat)
        if masked is None:
            masked = bool((masks != -1).any())
        return (np.concatenate(ints, dtype=np.int32), np.concatenate(floats),
                masks if masked else None)

    def unpack(self, ibuf: jax.Array, fbuf: jax.Array, masks: jax.Array | None = None
               ) -> StepArrays:
        """The step's arrays from its buffers; ``masks`` None: every token allowed (a
        forward that does not sample, as a pipeline stage's)."""
        leaves = []
        for dtype, shape, is_float, offset in self.fields:
            n = int(np.prod(shape))
            flat = jax.lax.slice_in_dim(fbuf if is_float else ibuf, offset, offset + n)
            if dtype == np.bool_:
                flat = flat != 0
            elif dtype == np.uint32:
                flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
            leaves.append(flat.reshape(shape))
        leaves.insert(self.mask_at, jnp.full(self.mask_shape, -1, jnp.int32)
                      if masks is None else masks)
        return jax.tree.unflatten(self.treedef, leaves)

    def host_arrays(self, ibuf: np.ndarray, fbuf: np.ndarray,
                    masks: np.ndarray | None = None) -> StepArrays:
        """``pack``'s inverse on the host: the ``StepArrays`` of two packed numpy buffers
        and the bitmask (None: every token allowed), each leaf a copy in its own dtype (a
        step built packed, ``StepBuilder._advance``)."""
        leaves = []
        for dtype, shape, is_float, offset in self.fields:
            flat = (fbuf if is_float else ibuf)[offset:offset + int(np.prod(shape))]
            flat = flat.view(dtype).copy() if dtype == np.uint32 else flat.astype(dtype)
            leaves.append(flat.reshape(shape))
        leaves.insert(self.mask_at, np.full(self.mask_shape, -1, np.int32) if masks is None
                      else np.array(masks, np.int32))
        return jax.tree.unflatten(self.treedef, leaves)


def _fed(token_fed: jax.Array, state_rows: jax.Array, tokens: jax.Array,
         last_tokens: jax.Array) -> jax.Array:
    """``tokens`` with each fed one (``token_fed``) replaced by its sequence's last sample."""
    return jnp.where(token_fed, last_tokens[state_rows], tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInputs:
    """What the sampling executable takes, every row padded to the engine's largest row
    count: one sampling program (the filters' top-k and sort, top-k logprobs) serves every
    step shape instead of being compiled into each. The step hands on the logits; the rest
    the host makes from the step's buffers (``sample_inputs``)."""

    logits: jax.Array          # [vocab, R] float32: vocabulary-major (``decoder.head_logits``)
    state_rows: jax.Array      # [R]
    sampled_state_rows: jax.Array  # [R]
    sampling: SamplingBatch    # [R] rows
    any_random: jax.Array
    any_penalty: jax.Array
    want_logprobs: jax.Array
    any_bias: jax.Array

    @property
    def rows(self) -> int:
        """The padded rows (the logits' second axis: they are vocabulary-major)."""
        return self.state_rows.shape[0]


def sample_inputs(arrays: StepArrays, logits: jax.Array, rows: int | None = None,
                  sink: int = 0) -> SampleInputs:
    """A step's ``SampleInputs``: its ``logits`` and what ``arrays`` say of its rows. On
    the device (the fused step's own rows), or on the host with ``rows`` (numpy
    ``arrays``, ``PackedLayout.host_arrays``): every row field padded to ``rows``, the
    padding rows neutral and their state rows ``sink``, as the sampling executable takes
    them (the step hands on only the logits, padded itself)."""
    if rows is None:
        pad, sampling = (lambda a: a), arrays.sampling
    else:
        pad = lambda a: np.pad(a, (0, rows - a.shape[0]), constant_values=sink)
        sampling = pad_rows(arrays.sampling, rows)
    return SampleInputs(logits=logits, state_rows=pad(arrays.state_rows),
                        sampled_state_rows=pad(arrays.sampled_state_rows), sampling=sampling,
                        any_random=arrays.any_random, any_penalty=arrays.any_penalty,
                        want_logprobs=arrays.want_logprobs, any_bias=arrays.any_bias)


def leaf_spec(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
    """One abstract array."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def sampling_spec(s: int, vocab_size: int, sharding=None) -> SamplingBatch:
    f32, i32 = jnp.float32, jnp.int32
    spec = lambda shape, dtype: leaf_spec(shape, dtype, sharding)
    return SamplingBatch(
        temperature=spec((s,), f32), top_k=spec((s,), i32), top_p=spec((s,), f32),
        min_p=spec((s,), f32), repetition_penalty=spec((s,), f32),
        presence_penalty=spec((s,), f32), frequency_penalty=spec((s,), f32),
        seed=spec((s,), jnp.uint32), step=spec((s,), i32),
        banned_ids=spec((s, MAX_BANNED_IDS), i32),
        allowed=spec((s, mask_words(vocab_size)), i32), draft=spec((s,), i32),
        bias_ids=spec((s, MAX_LOGIT_BIAS), i32), bias_values=spec((s, MAX_LOGIT_BIAS), f32))


def state_spec(cfg: ModelConfig, rows: int, sharding=None) -> SeqState:
    """The abstract penalty state of ``rows`` rows (a runner built on specs, ``abstract=True``)."""
    return SeqState(leaf_spec((rows, cfg.vocab_size), jnp.int32, sharding),
                    leaf_spec((rows, cfg.vocab_size), jnp.bool_, sharding),
                    leaf_spec((rows,), jnp.int32, sharding))


def new_state(cfg: ModelConfig, rows: int, sharding=None) -> SeqState:
    """The zeroed penalty state of ``rows`` rows."""
    return jax.device_put(SeqState(jnp.zeros((rows, cfg.vocab_size), jnp.int32),
                                   jnp.zeros((rows, cfg.vocab_size), bool),
                                   jnp.zeros((rows,), jnp.int32)), sharding)


def abstract_of(tree):
    """``tree``'s arrays (or specs) as ``ShapeDtypeStruct``s with their shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=getattr(x, "sharding", None)),
                        tree)


def arrays_spec(buckets: Buckets, vocab_size: int, num_decodes: int,
                num_prefill_tokens: int, hybrid: bool = False, lora: bool = False
                ) -> StepArrays:
    """Abstract shapes of a bucket's inputs (what ``StepBuilder`` fills); ``hybrid``: two
    KV layer groups, the windowed layers' slots and page table too; ``lora``: adapters
    served, each token's slot."""
    t = num_decodes + num_prefill_tokens
    s = num_decodes + (buckets.prefill_rows if num_prefill_tokens else 0)
    i32 = jnp.int32
    attn = AttentionMetadata(
        positions=leaf_spec((t,), i32), token_seq=leaf_spec((t,), i32),
        kv_lens=leaf_spec((s,), i32),
        page_table=leaf_spec((s, buckets.page_table_width), i32),
        num_prefills=leaf_spec((), i32), num_decodes=num_decodes)
    sampling = sampling_spec(s, vocab_size)
    return StepArrays(
        batch=StepInput(tokens=leaf_spec((t,), i32), slots=leaf_spec((t,), i32),
                        logits_rows=leaf_spec((s,), i32), attn=attn,
                        slot_groups=leaf_spec((t,), i32), start_groups=leaf_spec((s,), i32),
                        **({"local_slots": leaf_spec((t,), i32),
                            "local_page_table": leaf_spec((s, buckets.page_table_width), i32)}
                           if hybrid else {}),
                        **({"lora_slots": leaf_spec((t,), i32)} if lora else {})),
        token_state_rows=leaf_spec((t,), i32), token_is_prompt=leaf_spec((t,), bool),
        token_fed=leaf_spec((t,), bool), state_rows=leaf_spec((s,), i32),
        prompt_targets=leaf_spec((t,), i32), want_prompt_logprobs=leaf_spec((), bool),
        prompt_top=leaf_spec((), i32),
        reset_rows=leaf_spec((s,), i32), sampled_state_rows=leaf_spec((s,), i32),
        sampling=sampling,
        any_random=leaf_spec((), bool), any_penalty=leaf_spec((), bool),
        want_logprobs=leaf_spec((), bool), any_bias=leaf_spec((), bool),
        whole_chain=leaf_spec((), bool), burst=leaf_spec((), i32))


def sample_inputs_spec(rows: int, vocab_size: int, sharding=None) -> SampleInputs:
    """Abstract ``SampleInputs`` of ``rows`` padded rows, every leaf on ``sharding``."""
    b = lambda: leaf_spec((), bool, sharding)
    return SampleInputs(logits=leaf_spec((vocab_size, rows), jnp.float32, sharding),
                        state_rows=leaf_spec((rows,), jnp.int32, sharding),
                        sampled_state_rows=leaf_spec((rows,), jnp.int32, sharding),
                        sampling=sampling_spec(rows, vocab_size, sharding),
                        any_random=b(), any_penalty=b(),
                        want_logprobs=b(), any_bias=b())

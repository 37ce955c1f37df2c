"""Batched token sampling on device (pure, jittable JAX; vLLM semantics).

Pipeline per row: logit bias -> penalties -> banned ids -> structured-output mask ->
(greedy: argmax) | (temperature -> top-k -> top-p -> min-p -> Gumbel-max). Randomness comes
only from ``fold_in(key(seed), step)`` of the row itself, so a seeded request draws the same
tokens whatever else is in the batch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jserve import backend as jserve_backend
from jserve.sampling.params import MAX_BANNED_IDS, MAX_LOGIT_BIAS, SamplingParams

# Non-greedy temperatures are floored here so that ``logits / temperature`` stays finite.
_MIN_TEMPERATURE = 1e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as arrays (numpy on host, jax on device)."""

    temperature: jax.Array  # f32[B]; 0 = greedy
    top_k: jax.Array  # i32[B]; <= 0 = disabled
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    seed: jax.Array  # u32[B]
    step: jax.Array  # i32[B]; index of the token being generated
    banned_ids: jax.Array  # i32[B, MAX_BANNED_IDS]; -1 padded
    # i32[B, W]: bit j of word i allows token 32 i + j (structured output); words past W
    # allow everything, so all-ones rows (-1) and a 1-word batch change nothing.
    allowed: jax.Array
    # i32[B]: the draft token this row verifies (speculative decoding), -1 for none. The
    # row then returns the draft if accepted, else a token from the residual distribution
    # (never the draft), so "returned == draft" is the acceptance.
    draft: jax.Array
    # i32[B, MAX_LOGIT_BIAS] token ids (-1 padded) and f32[B, MAX_LOGIT_BIAS] biases added to
    # their logits (``logit_bias``): sparse, so a step carries no [rows, vocab] array.
    bias_ids: jax.Array
    bias_values: jax.Array


# What a padding row holds in each field: greedy, neutral penalties (bit-exact no-ops), no
# banned ids, so it samples nothing that anyone reads and costs no random draws.
NEUTRAL_ROW_VALUES = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                          presence_penalty=0.0, frequency_penalty=0.0, seed=0, step=0,
                          banned_ids=-1, allowed=-1, draft=-1, bias_ids=-1, bias_values=0.0)


def pad_rows(sb: SamplingBatch, rows: int) -> SamplingBatch:
    """``sb`` (numpy arrays, any row count <= ``rows``) padded with neutral rows to
    ``rows``, so one sampling executable serves every step shape."""
    def pad(name: str, a: np.ndarray) -> np.ndarray:
        widths = [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)
        return np.pad(a, widths, constant_values=np.asarray(NEUTRAL_ROW_VALUES[name], a.dtype))
    return SamplingBatch(**{f.name: pad(f.name, getattr(sb, f.name))
                            for f in dataclasses.fields(SamplingBatch)})


class SamplerRow(NamedTuple):
    """Host-side description of one row; ``seed`` is already resolved by the engine. A
    NamedTuple: the engine makes one per sampled row every step, several times cheaper
    than a frozen dataclass."""

    params: SamplingParams
    seed: int
    step: int
    banned_ids: tuple[int, ...] = ()
    allowed: np.ndarray | None = None  # int32 bitmask of the tokens allowed next (None: all)
    draft: int = -1  # speculative decoding: the draft token this row verifies


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]; raw log-softmax of the chosen token
    top_ids: jax.Array  # i32[B, n]
    top_logprobs: jax.Array  # f32[B, n]


def mask_words(vocab_size: int) -> int:
    """Words of a structured-output bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


# Float and int32 fields of ``SamplingBatch`` filled from each row's ``SamplingParams``
# (``make_sampling_batch``), in column order.
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_NEUTRAL_FLOATS = tuple(NEUTRAL_ROW_VALUES[f] for f in _FLOAT_FIELDS)
_NEUTRAL_INTS = (NEUTRAL_ROW_VALUES["top_k"], NEUTRAL_ROW_VALUES["step"],
                 NEUTRAL_ROW_VALUES["draft"])


def make_sampling_batch(rows: Sequence[SamplerRow], pad_to: int, words: int = 1
                        ) -> SamplingBatch:
    """Pack rows into fixed-size numpy arrays; padding rows are greedy with neutral penalties.
    ``words``: the width of the ``allowed`` bitmask (``mask_words(vocab)`` in the engine).

    Runs every engine step: one pass over the rows builds a tuple per row for the float
    fields and one for the int fields, each turned into an array by one ``np.array`` call;
    ban lists and masks are written only for the rows that have them.
    """
    n = len(rows)
    n_pad = pad_to - n
    if n_pad < 0:
        raise ValueError(f"pad_to={pad_to} is smaller than the number of rows ({n})")
    floats = [(p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
               p.frequency_penalty) for p in (r.params for r in rows)]
    ints = [(max(r.params.top_k, 0), r.step, r.draft) for r in rows]
    f = np.array(floats + [_NEUTRAL_FLOATS] * n_pad, np.float32).reshape(pad_to, 6).T.copy()
    i = np.array(ints + [_NEUTRAL_INTS] * n_pad, np.int32).reshape(pad_to, 3).T.copy()
    seed = np.zeros(pad_to, np.uint32)
    seed[:n] = [r.seed for r in rows]
    banned = np.full((pad_to, MAX_BANNED_IDS), -1, np.int32)
    allowed = np.full((pad_to, words), -1, np.int32)
    bias_ids = np.full((pad_to, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((pad_to, MAX_LOGIT_BIAS), np.float32)
    for j, r in enumerate(rows):
        if r.params.logit_bias:
            k = len(r.params.logit_bias)
            bias_ids[j, :k] = list(r.params.logit_bias)
            bias_values[j, :k] = list(r.params.logit_bias.values())
        if r.banned_ids:
            if len(r.banned_ids) > MAX_BANNED_IDS:
                raise ValueError(f"banned_ids must have at most {MAX_BANNED_IDS} ids, "
                                 f"got {len(r.banned_ids)}")
            banned[j, :len(r.banned_ids)] = r.banned_ids
        if r.allowed is not None:
            allowed[j] = r.allowed
    return SamplingBatch(**dict(zip(_FLOAT_FIELDS, f)), top_k=i[0], step=i[1],
                         draft=i[2], seed=seed, banned_ids=banned, allowed=allowed,
                         bias_ids=bias_ids, bias_values=bias_values)


def apply_bias(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """``logit_bias``: each row's biases added to its logits (-1 ids, padding, dropped)."""
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(logits.shape[0])[:, None]
    cols = jnp.where(sb.bias_ids >= 0, sb.bias_ids, logits.shape[1])
    return logits.at[rows, cols].add(sb.bias_values, mode="drop")


def apply_penalties(logits: jax.Array, output_counts: jax.Array, prompt_mask: jax.Array,
                    sb: SamplingBatch) -> jax.Array:
    """Repetition (prompt or output tokens), then frequency and presence (output tokens).

    Written as ``x / 1.0`` and ``x - 0.0`` for default values so they are bit-exact no-ops.
    """
    logits = logits.astype(jnp.float32)
    in_output = output_counts > 0
    r = sb.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(prompt_mask | in_output, repeated, logits)
    logits = logits - sb.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    return logits - sb.presence_penalty[:, None] * in_output.astype(jnp.float32)


def _ban(logits: jax.Array, banned_ids: jax.Array) -> jax.Array:
    vocab = logits.shape[1]
    rows = jnp.arange(logits.shape[0])[:, None]
    # -1 padding is mapped out of range and dropped (negative ids would wrap around).
    cols = jnp.where(banned_ids >= 0, banned_ids, vocab)
    return logits.at[rows, cols].set(-jnp.inf, mode="drop")


# ``allowed_mask`` reads the first this many tokens of each row (``lax.top_k``) and sorts
# only a row they do not decide: XLA:CPU sorted 36 x 32768 float32 logits in 254 ms, against
# 5 ms for their top 256.
FILTER_PREFIX = 256


def allowed_mask(scaled_logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Tokens that survive top-k, then top-p (on the renormalised top-k), then min-p.

    All three filters keep a prefix of the descending order (ties: lower id first), so the
    result is "the first n sorted tokens" and is mapped back to vocab order by comparing
    against the n-th token (value, id) instead of scattering. The argmax is always kept.
    A row with no filter keeps every finite token. Otherwise the row's first
    ``FILTER_PREFIX`` tokens decide n when it falls inside them (and top-k is off, or
    within them); a row they do not decide (a nucleus wider than the prefix) is sorted
    whole, alone (``_sorted_cutoff``).
    """
    # Canonicalise -0.0 so the order and the == comparison below agree.
    logits = jnp.where(scaled_logits == 0, 0.0, scaled_logits.astype(jnp.float32))
    batch, vocab = logits.shape
    ids = lax.broadcasted_iota(jnp.int32, (batch, vocab), 1)
    top_k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, vocab), vocab)
    unfiltered = (top_k == vocab) & (sb.top_p >= 1.0) & (sb.min_p <= 0.0)
    finite = logits > -jnp.inf
    every = finite | ((ids == 0) & ~jnp.any(finite, axis=-1, keepdims=True))

    def filtered() -> jax.Array:
        width = min(FILTER_PREFIX, vocab)
        values, order = lax.top_k(logits, width)  # descending, ties by lower id
        row_mass = jnp.sum(jnp.exp(logits - logits.max(axis=-1, keepdims=True)), axis=-1)
        n_keep, decided = _kept_prefix(values, top_k, sb.top_p, sb.min_p, row_mass)
        decided = (decided & ((top_k <= width) | (top_k == vocab))) | unfiltered
        # The last kept token, read by a reduction (so is the first, in ``_kept_prefix``).
        last = lax.broadcasted_iota(jnp.int32, values.shape, 1) == (n_keep - 1)[:, None]
        cut = (jnp.max(jnp.where(last, values, -jnp.inf), axis=-1),
               jnp.max(jnp.where(last, order, -1), axis=-1))

        def sort_undecided():
            def one(i):
                return lax.cond(decided[i], lambda: (cut[0][i], cut[1][i]),
                                lambda: _sorted_cutoff(logits[i], top_k[i], sb.top_p[i],
                                                       sb.min_p[i]))
            return lax.map(one, jnp.arange(batch))

        value, last = lax.cond(jnp.all(decided), lambda: cut, sort_undecided)
        kept = (logits > value[:, None]) | ((logits == value[:, None])
                                            & (ids <= last[:, None]))
        return jnp.where(unfiltered[:, None], every, kept)

    return lax.cond(jnp.all(unfiltered), lambda: every, filtered)


def _kept_prefix(values: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                 row_mass: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The filters on rows of descending ``values`` [B, n] (a row's first n tokens, or all
    of them): how many tokens lead the kept run (>= 1), and whether the run ends inside
    them. Top-p renormalises over the top-k tokens: where they reach past the n, over
    ``row_mass`` (the whole row's softmax normaliser: given when the n are a prefix)."""
    n = values.shape[1]
    rank = lax.broadcasted_iota(jnp.int32, values.shape, 1)
    in_top_k = rank < top_k[:, None]
    # The first value as a reduction: a slice of XLA:CPU's top-k output (a partial sort)
    # besides the prefix made XLA fold it into a sort of the whole row.
    first = values.max(axis=-1, keepdims=True)
    shifted = jnp.where(in_top_k, values - first, -jnp.inf)
    exp = jnp.exp(shifted)
    mass = jnp.sum(exp, axis=-1)
    if row_mass is not None:
        mass = jnp.where(top_k > n, row_mass, mass)
    cumulative = jnp.cumsum(exp / mass[:, None], axis=-1)
    mass_before = jnp.pad(cumulative[:, :-1], ((0, 0), (1, 0)))
    in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    in_min_p = jnp.exp(values - first) >= min_p[:, None]
    keep = in_top_k & in_top_p & in_min_p & (values > -jnp.inf)
    # Length of the leading run of kept tokens (robust to rounding in the cumsum).
    run = jnp.min(jnp.where(keep, n, rank), axis=-1)
    return jnp.maximum(run, 1), run < n


def _sorted_cutoff(row: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """The last kept token (value, id) of one row [vocab], from its whole stable sort."""
    ids = lax.broadcasted_iota(jnp.int32, row.shape, 0)
    neg_sorted, order = lax.sort((-row, ids), is_stable=True, num_keys=1)
    n_keep, _ = _kept_prefix(-neg_sorted[None], top_k[None], top_p[None], min_p[None])
    return -neg_sorted[n_keep[0] - 1], order[n_keep[0] - 1]


def _row_gumbel(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.gumbel(key, (vocab,), dtype=jnp.float32)


def _row_uniform(seed: jax.Array, step: jax.Array) -> jax.Array:
    """The acceptance draw of a speculative row: a stream apart from its Gumbel noise."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), 1)
    return jax.random.uniform(key, (), dtype=jnp.float32)


def unpack_allowed(allowed: jax.Array, vocab: int) -> jax.Array:
    """bool[B, vocab] from the ``allowed`` bitmask (tokens past its words: allowed)."""
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    flat = bits.reshape(allowed.shape[0], -1).astype(bool)
    if flat.shape[1] >= vocab:
        return flat[:, :vocab]
    return jnp.pad(flat, ((0, 0), (0, vocab - flat.shape[1])), constant_values=True)


def _first_hit(x: jax.Array, top: jax.Array, axis: int = -1) -> jax.Array:
    """The first index along ``axis`` where ``x`` equals ``top`` (or is NaN where ``top``
    is), int32; the axis length where none does."""
    axis %= x.ndim
    hit = (x == top) | (jnp.isnan(top) & jnp.isnan(x))
    ids = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(hit, ids, x.shape[axis]).min(axis=axis)


# ``row_argmax``'s chunk: rows of a vocabulary it divides are read once, as chunk maxima.
ARGMAX_CHUNK = 128


def row_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` of a [rows, vocab] array as int32: the first index of the
    row's maximum. On XLA:CPU argmax's variadic (value, index) reduce runs element by
    element (1.7 ms of a 1.9 ms sampler at 36 x 8192 rows; docs/bench.md), so it is built
    from plain reductions that vectorize. A vocabulary that ``ARGMAX_CHUNK`` divides is read
    once: the maximum of each chunk, the row's maximum over those, the first chunk holding
    it, then the first index holding it inside that chunk (0.23 against 0.50 ms at 36 x
    32768: the lowest index of the maximum over the whole row was a second full pass).
    Other vocabularies: the maximum, then the lowest index holding it. (XLA:CPU's
    vectorized max drops NaNs, so a row with a NaN gets its largest number's index rather
    than the first NaN's as ``jnp.argmax`` would.) Other backends keep ``jnp.argmax``."""
    return _argmax(x, 1)


def vocab_argmax(x: jax.Array) -> jax.Array:
    """``row_argmax`` of vocabulary-major logits [vocab, rows] (``SampleInputs.logits``):
    each column's first maximum, read the same way, without transposing them."""
    return _argmax(x, 0)


def _argmax(x: jax.Array, axis: int) -> jax.Array:
    """``row_argmax`` along ``axis`` (1: [rows, vocab], 0: [vocab, rows])."""
    if jserve_backend.current() != "cpu":
        return jnp.argmax(x, axis=axis).astype(jnp.int32)
    vocab = x.shape[axis]
    if x.ndim != 2 or vocab % ARGMAX_CHUNK or vocab < 8 * ARGMAX_CHUNK:
        return _first_hit(x, x.max(axis=axis, keepdims=True), axis)
    rows, per = x.shape[1 - axis], vocab // ARGMAX_CHUNK
    chunks = x.reshape((rows, per, ARGMAX_CHUNK) if axis else (per, ARGMAX_CHUNK, rows))
    chunk_max = chunks.max(axis=axis + 1)  # [rows, per] or [per, rows]
    top = chunk_max.max(axis=axis, keepdims=True)
    chunk = _first_hit(chunk_max, top, axis)
    part = jnp.take_along_axis(chunks, jnp.expand_dims(chunk, (axis, axis + 1)),
                               axis=axis).squeeze(axis)  # the chunk: [rows, C] or [C, rows]
    return chunk * ARGMAX_CHUNK + _first_hit(part, top, axis)


def plain_greedy(sb: SamplingBatch, any_modifier: jax.Array) -> jax.Array:
    """Whether every row of ``sb`` takes the plain argmax of its logits (a traced bool):
    greedy, no ban, no structured-output mask, and ``any_modifier`` (some row samples, has
    a penalty or a logit bias) false. Then the token is ``row_argmax(logits)`` read in
    place, bit for bit what the full chain gives (its steps are no-ops on such rows), with
    no copy of the [rows, vocab] logits (``step_program._sample``)."""
    return ~any_modifier & ~jnp.any(sb.banned_ids >= 0) & ~jnp.any(sb.allowed != -1)


def temperature_only(sb: SamplingBatch, vocab: int) -> jax.Array:
    """Whether ``temperature_tokens`` gives every row of ``sb`` its token, as
    ``choose_tokens`` would (a traced bool; logit biases and penalties are the caller's to
    rule out): no ban or structured-output mask, and no row that samples has a filter or
    a draft (a greedy row takes its argmax whatever it asks)."""
    samples = sb.temperature > 0
    beyond = (((sb.top_k > 0) & (sb.top_k < vocab)) | (sb.top_p < 1.0) | (sb.min_p > 0.0)
              | (sb.draft >= 0))
    return (~jnp.any(samples & beyond) & ~jnp.any(sb.banned_ids >= 0)
            & ~jnp.any(sb.allowed != -1))


def _draws(logits: jax.Array, sb: SamplingBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(greedy rows [B], logits / temperature, each row's Gumbel noise [B, vocab])."""
    greedy = sb.temperature == 0
    temperature = jnp.where(greedy, 1.0, jnp.maximum(sb.temperature, _MIN_TEMPERATURE))
    gumbel = jax.vmap(_row_gumbel, in_axes=(0, 0, None))(sb.seed, sb.step, logits.shape[1])
    return greedy, logits / temperature[:, None], gumbel


def temperature_tokens(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """The tokens ``choose_tokens`` gives rows that are greedy or sample at a temperature
    with nothing else (no ban, mask, filter or draft; ``logits`` [B, vocab] unbiased,
    unpenalised), bit for bit: the fused step's sampling (``step_program._common_tokens``),
    without the filters' top-k and sort, a quarter to two fifths of its compile time."""
    logits = logits.astype(jnp.float32)
    greedy, scaled, gumbel = _draws(logits, sb)
    return jnp.where(greedy, row_argmax(logits), row_argmax(scaled + gumbel))


def choose_tokens(penalised: jax.Array, sb: SamplingBatch, *, all_greedy: bool) -> jax.Array:
    """Pick one token per row from penalised logits; ``all_greedy`` (static) skips the sort
    and the random draws when every row has temperature 0."""
    penalised = _ban(penalised.astype(jnp.float32), sb.banned_ids)
    vocab = penalised.shape[1]
    # Unpacking the bitmask is vocab x rows of work, done only when some row is constrained
    # (a free row's words are all ones) where a branch is cheap.
    mask = lambda x: jnp.where(unpack_allowed(sb.allowed, vocab), x, -jnp.inf)
    if jserve_backend.branches_cheap():
        penalised = lax.cond(jnp.any(sb.allowed != -1), mask, lambda x: x, penalised)
    else:  # a free row's mask keeps every token
        penalised = mask(penalised)
    tokens = row_argmax(penalised)
    if all_greedy:
        return tokens
    greedy, scaled, gumbel = _draws(penalised, sb)
    allowed = allowed_mask(scaled, sb)
    # Speculative rows (rejection sampling against a draft d proposed with certainty):
    # accept d with probability p(d), else draw from p with d removed, renormalised; the
    # token returned is then distributed exactly as p. Rows without a draft are untouched.
    has_draft = sb.draft >= 0
    draft = jnp.maximum(sb.draft, 0)
    is_draft = has_draft[:, None] & (lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
                                     == draft[:, None])
    log_p = jax.nn.log_softmax(jnp.where(allowed, scaled, -jnp.inf), axis=-1)
    p_draft = jnp.exp(jnp.take_along_axis(log_p, draft[:, None], axis=1)[:, 0])
    uniform = jax.vmap(_row_uniform)(sb.seed, sb.step)
    # (Rounding can leave p(d) a hair under 1 with nothing else allowed: accept then too.)
    accept = has_draft & ((uniform < p_draft) | ~jnp.any(allowed & ~is_draft, axis=-1))
    perturbed = jnp.where(allowed & ~is_draft, scaled + gumbel, -jnp.inf)
    sampled = jnp.where(accept, draft, row_argmax(perturbed))
    return jnp.where(greedy, tokens, sampled)


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of the raw model distribution: the chosen token's and the top ``num_logprobs``."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
    if num_logprobs:
        top_logprobs, top_ids = lax.top_k(logprobs, num_logprobs)
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return chosen, top_ids.astype(jnp.int32), top_logprobs


def sample(logits: jax.Array, output_counts: jax.Array, prompt_mask: jax.Array,
           sb: SamplingBatch, *, all_greedy: bool, num_logprobs: int) -> SampleResult:
    """Logit bias, penalties, then token choice, then logprobs; ``all_greedy`` and
    ``num_logprobs`` are static. Logprobs are of the raw model distribution (before bias,
    penalties and temperature, as vLLM's default ``raw_logprobs``)."""
    penalised = apply_penalties(apply_bias(logits, sb), output_counts, prompt_mask, sb)
    tokens = choose_tokens(penalised, sb, all_greedy=all_greedy)
    chosen, top_ids, top_logprobs = token_logprobs(logits, tokens, num_logprobs)
    return SampleResult(tokens=tokens, logprobs=chosen, top_ids=top_ids,
                        top_logprobs=top_logprobs)

"""Query row blocks: the layout both Pallas flavours tile a ragged batch into, the per-block
online-softmax step they share, and the log-sum-exp merge of partial results.

A token of a GQA model carries G = Hq / Hkv query heads that all read the same KV head, so
the kernels work on *rows* (token, head-in-group) per KV head: one KV page loaded from the
paged cache serves every query head of the group. Rows are grouped into blocks of
``tokens_per_block`` consecutive tokens (padded to a power of two, at least 16 rows: the
smallest Triton matmul and a whole bf16 TPU sublane tile). A block may hold tokens of several
sequences; the kernels loop over the sequences a block touches, ``seq_lo .. seq_hi - 1``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MASKED = -1e30
MIN_ROWS = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where tokens ``start .. stop - 1`` of a step sit in blocks of ``tokens_per_block``
    tokens, each ``group`` rows (what a kernel needs besides q, the same in every layer, so a
    step computes it once before its layer loop: ``kernels.with_row_layouts``). seq/pos [NB, R]
    (seq -1 for padding rows); seq_lo/seq_hi [NB]: the live sequences each block touches.
    tok_pos [NB * tokens_per_block] and q_end [S] (one past each sequence's last token) let a
    kernel find, with scalar reads only, the last position of sequence s inside block b: the
    causal end of its KV loop; q_start [S] (each sequence's first token) its first position
    there, where a sliding window's KV loop starts."""

    seq: jax.Array
    pos: jax.Array
    seq_lo: jax.Array
    seq_hi: jax.Array
    tok_pos: jax.Array
    q_end: jax.Array
    q_start: jax.Array
    start: int = dataclasses.field(metadata=dict(static=True))
    stop: int = dataclasses.field(metadata=dict(static=True))
    tokens_per_block: int = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))


def rows_per_block(tokens_per_block: int, group: int) -> int:
    return max(MIN_ROWS, 1 << (tokens_per_block * group - 1).bit_length())


def row_layout(positions: jax.Array, token_seq: jax.Array, num_live: jax.Array, num_seqs: int,
               group: int, tokens_per_block: int, start: int = 0,
               stop: int | None = None) -> RowLayout:
    """The layout of tokens ``start .. stop - 1`` of positions/token_seq [T] (a token is live
    when its sequence is ``< num_live``; ``num_seqs`` sequence rows in all)."""
    stop = positions.shape[0] if stop is None else stop
    g, bt = group, tokens_per_block
    nb = -(-(stop - start) // bt)
    r = rows_per_block(bt, g)
    pad = nb * bt - (stop - start)
    token_seq, positions = token_seq[start:stop], positions[start:stop]
    seq = jnp.pad(jnp.where(token_seq < num_live, token_seq, -1), (0, pad), constant_values=-1)
    pos = jnp.pad(positions, (0, pad))

    def rows(x):  # per token [NB * bt] -> per row [NB, R]
        x = jnp.repeat(x.reshape(nb, bt), g, axis=1)
        return jnp.pad(x, ((0, 0), (0, r - bt * g)), constant_values=-1)

    blk_seq = seq.reshape(nb, bt)
    hi = jnp.where(blk_seq >= 0, blk_seq + 1, 0).max(axis=1)
    lo = jnp.minimum(jnp.where(blk_seq >= 0, blk_seq, num_seqs).min(axis=1), hi)
    at = jnp.where(seq >= 0, seq, num_seqs)
    q_end = jnp.zeros(num_seqs, jnp.int32).at[at].max(
        jnp.arange(1, nb * bt + 1, dtype=jnp.int32), mode="drop")
    q_start = jnp.full(num_seqs, nb * bt - 1, jnp.int32).at[at].min(
        jnp.arange(nb * bt, dtype=jnp.int32), mode="drop")
    return RowLayout(seq=rows(seq), pos=rows(pos), seq_lo=lo, seq_hi=hi, tok_pos=pos,
                     q_end=q_end, q_start=q_start, start=start, stop=stop,
                     tokens_per_block=bt, group=g)


def find_layout(layouts, start: int, stop: int, group: int, tokens_per_block: int
                ) -> RowLayout | None:
    """The one of ``layouts`` (a step's, made before its layer loop) for these tokens and
    blocking, or None."""
    for lay in layouts or ():
        if (lay.start, lay.stop, lay.group, lay.tokens_per_block) == \
                (start, stop, group, tokens_per_block):
            return lay
    return None


def block_rows(q: jax.Array, layout: RowLayout) -> jax.Array:
    """Tokens q [T, Hq, D] (the layout's tokens) tiled into its blocks: [Hkv, NB, R, D]."""
    t, hq, d = q.shape
    g, bt = layout.group, layout.tokens_per_block
    hkv = hq // g
    nb, r = layout.seq.shape
    qg = jnp.pad(q, ((0, nb * bt - t), (0, 0), (0, 0))).reshape(nb, bt, hkv, g, d)
    qg = qg.transpose(2, 0, 1, 3, 4).reshape(hkv, nb, bt * g, d)
    return jnp.pad(qg, ((0, 0), (0, 0), (0, r - bt * g), (0, 0)))


def unblock(x: jax.Array, num_tokens: int, group: int, tokens_per_block: int) -> jax.Array:
    """[Hkv, NB, R, ...] -> [T, Hkv * G, ...]: drops padding rows and tokens."""
    hkv, nb = x.shape[:2]
    rest = x.shape[3:]
    x = x[:, :, :tokens_per_block * group].reshape(hkv, nb * tokens_per_block, group, *rest)
    x = jnp.moveaxis(x[:, :num_tokens], 0, 1)
    return x.reshape(num_tokens, hkv * group, *rest)


def causal_end(b, s, blocks_tok_pos, q_end, kv_len, tokens_per_block):
    """KV length sequence ``s`` needs in block ``b``: up to its last query position there
    (tokens of a sequence are consecutive with rising positions), capped by its context."""
    last = jnp.minimum((b + 1) * tokens_per_block, q_end[s]) - 1
    return jnp.minimum(kv_len, blocks_tok_pos[last] + 1)


def window_start(pos, window):
    """The first key position a query at ``pos`` reads under a sliding ``window`` (keys k with
    pos - window < k <= pos, HF's convention; window 0: every key, so 0)."""
    return jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)


def window_first_page(b, s, blocks_tok_pos, q_start, window, page_size, tokens_per_block):
    """The first KV page sequence ``s``'s rows in block ``b`` read under ``window``: the page
    of its first row's first key (its rows' positions rise, so that row reads furthest
    back)."""
    first = jnp.maximum(b * tokens_per_block, q_start[s])
    # lax.div (truncating; the start is >= 0): Mosaic lowers ``//``'s sign fix-up only on a TPU
    return jax.lax.div(window_start(blocks_tok_pos[first], window), jnp.int32(page_size))


def attend_block(carry, q, k, v, valid, scale):
    """One online-softmax step of a query block q [R, D] over a KV page k, v [C, D]; the
    carry is (m [R, 1], l [R, 1], acc [R, D]) in float32. Kept 2-D for Mosaic's layouts."""
    m, l, acc = carry
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid, s, MASKED)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)
    return m_new, alpha * l + p.sum(axis=1, keepdims=True), alpha * acc + pv


def init_carry(rows: int, head_dim: int):
    return (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def finish(m, l, acc):
    """(out [R, D], lse [R, 1]); rows that saw no key get 0 and -inf, as in the reference."""
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)
    return out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def merge_partials(out: jax.Array, lse: jax.Array, reduce_max=lambda x: x.max(axis=0),
                   reduce_sum=lambda x: x.sum(axis=0)) -> tuple[jax.Array, jax.Array]:
    """Combines attention over disjoint KV parts, each normalised over its own part, by their
    log-sum-exps. By default the parts are the leading axis (out [K, ..., D], lse [K, ...]);
    KV-cache parallelism passes collectives over a mesh axis instead. Parts that saw no key
    (lse -inf) weigh nothing; a row no part saw comes out 0 with lse -inf, never NaN."""
    top = reduce_max(lse)
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - safe_top), 0.0)[..., None]
    # The weights' sum rides as one more channel of the weighted sum: one reduction (one
    # launch on XLA:GPU, one collective under kv-parallelism) where two were.
    both = reduce_sum(jnp.concatenate([w * out.astype(jnp.float32), w], axis=-1))
    merged, total = both[..., :-1], both[..., -1]
    merged = merged / jnp.where(total > 0, total, 1.0)[..., None]
    return merged, jnp.where(total > 0, safe_top + jnp.log(total), -jnp.inf)


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """Attention ``out`` [T, H, D] (its log-sum-exp ``lse`` [T, H]) as if each head's
    softmax had one more logit, ``sinks`` [H], on a value of zero (gpt-oss's attention
    sinks): merged with an empty part whose log-sum-exp is the sink, the output scales by
    exp(lse) / (exp(lse) + exp(sink)). Every kernel's output takes it unchanged."""
    keep = jax.nn.sigmoid(lse - sinks.astype(jnp.float32))[..., None]
    return (out.astype(jnp.float32) * keep).astype(out.dtype)


def stacked(pages, layer):
    """(pages as a stacked cache [L, ...], layer as int32 [1]) for the kernels, which always
    address a layer of a stack: one layer's pages (``layer`` None) become a stack of one.
    ``pages`` may be quantized (both leaves)."""
    if layer is None:
        return jax.tree.map(lambda p: p[None], pages), jnp.zeros((1,), jnp.int32)
    return pages, jnp.asarray(layer, jnp.int32).reshape(1)

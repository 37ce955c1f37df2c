"""The device check's kernel cases: a ragged batch (decodes, a prefill chunk or both, with
padding) over a paged cache whose pages lie scattered over the pool, a kernel run on it against
the XLA reference (output, log-sum-exp, rows without keys), and both timed."""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from harness.device_profiles import Profile, ratio
from jserve.kernels import AttentionMetadata, attention, kv_quant, write_kv


def timed(fn, args, reps):
    """Median seconds of ``reps`` calls after one untimed call (compile, warm caches)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass
class Case:
    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    meta: AttentionMetadata
    slots: jax.Array          # flat cache slot of every token (padding: the sink page 0)
    kv_lens: list[int]        # live sequences' contexts
    positions: np.ndarray     # live tokens' positions
    num_tokens: int           # live tokens


def batch_sequences(p: Profile, kind: str, ctx: int, rng: np.random.Generator):
    """(cached, chunk) of each sequence; decodes first (a (0, 0) pair is a padding row)."""
    def lengths(n):  # mixed contexts up to ctx, the longest exactly ctx
        x = rng.integers(1, ctx + 1, n)
        x[0] = ctx
        return [(int(c) - 1, 1) for c in x]

    if kind == "decode":
        return lengths(p.decode_batch) + [(0, 0)], 0
    if kind == "prefill":
        chunk = min(p.prefill_chunk, ctx)
        return [(ctx - chunk, chunk)], 3
    n, chunk, fresh = p.mixed
    chunk, fresh = min(chunk, ctx), min(fresh, ctx)
    return lengths(n) + [(0, 0), (ctx - chunk, chunk), (0, fresh)], 3


def build_case(p: Profile, kind: str, ctx: int, seed: int) -> Case:
    """A ragged batch over a paged cache whose pages are scattered at random over the pool.
    Padding: a decode row with no context and (prefill, mixed) tokens owned by no row."""
    rng = np.random.default_rng(seed)
    seqs, pad_tokens = batch_sequences(p, kind, ctx, rng)
    shape_ctx = max(p.contexts) if p.fixed_shapes else ctx
    pages_of = [-(-(a + b) // p.page) for a, b in seqs]
    # The table width is a whole number of the kernels' 4-page KV pages. With fixed_shapes
    # width and pool size depend on the profile and kind only: every context reuses one
    # compiled kernel.
    pages_per_seq = -(-shape_ctx // p.page)
    width = -(-pages_per_seq // 4) * 4
    num_pages = 1 + (len(seqs) * width if p.fixed_shapes else sum(pages_of))
    free = 1 + rng.permutation(num_pages - 1)
    s = len(seqs) + 1                       # one extra padding row, as the engine pads
    table = np.zeros((s, width), np.int32)
    kv_lens = np.zeros(s, np.int32)
    positions, token_seq, slots = [], [], []
    used = 0
    for i, ((cached, chunk), n_pages) in enumerate(zip(seqs, pages_of)):
        table[i, :n_pages] = free[used:used + n_pages]
        used += n_pages
        kv_lens[i] = cached + chunk
        pos = np.arange(cached, cached + chunk) if chunk else np.zeros(1, np.int64)
        positions.append(pos)
        token_seq.append(np.full(len(pos), i))
        slots.append(table[i, pos // p.page] * p.page + pos % p.page if chunk
                     else np.zeros(1, np.int64))
    positions.append(np.zeros(pad_tokens, np.int64))
    token_seq.append(np.full(pad_tokens, s))
    slots.append(np.arange(pad_tokens) % p.page)   # into the sink page
    positions, token_seq, slots = map(np.concatenate, (positions, token_seq, slots))
    # Decode rows (one token each; the (0, 0) padding row too) come before the first chunk.
    num_decodes = next((i for i, (a, b) in enumerate(seqs) if b > 1), len(seqs))
    num_prefills = len(seqs) - num_decodes
    t = len(positions)
    dtype = jnp.dtype(p.dtype)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    pool = (p.hkv, num_pages, p.page, p.d)
    meta = AttentionMetadata(
        positions=jnp.asarray(positions, jnp.int32), token_seq=jnp.asarray(token_seq, jnp.int32),
        kv_lens=jnp.asarray(kv_lens), page_table=jnp.asarray(table),
        num_prefills=jnp.asarray(num_prefills, jnp.int32), num_decodes=num_decodes)
    live = [(a, b) for a, b in seqs if b]
    live_pos = np.concatenate([np.arange(a, a + b) for a, b in live])
    return Case(q=jax.random.normal(kq, (t, p.hq, p.d), dtype),
                k_pages=jax.random.normal(kk, pool, dtype),
                v_pages=jax.random.normal(kv, pool, dtype),
                meta=meta, slots=jnp.asarray(slots, jnp.int32),
                kv_lens=[a + b for a, b in live], positions=live_pos,
                num_tokens=len(live_pos))


def attention_work(p: Profile, case: Case) -> tuple[float, float]:
    """(FLOPs, compulsory bytes) of one attention call: QK^T and PV for every attended
    (query, key) pair; every live sequence's K and V read once, Q read and O written once."""
    pairs = float(np.sum(case.positions + 1))
    flops = 4 * p.d * p.hq * pairs
    rows = 2 * p.hkv * sum(case.kv_lens) + 2 * p.hq * case.num_tokens
    return flops, float(jnp.dtype(p.dtype).itemsize * p.d * rows)


def compare(out, lse, ref_out, ref_lse, tol) -> dict:
    """Max abs errors over rows with keys, the tolerance test, and the empty-row contract."""
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    lse, ref_lse = np.asarray(lse, np.float32), np.asarray(ref_lse, np.float32)
    empty = np.isneginf(ref_lse)
    live = ~empty
    d_out = np.abs(out[live] - ref_out[live])
    d_lse = np.abs(lse[live] - ref_lse[live])
    ok_out = bool(np.all(d_out <= tol + tol * np.abs(ref_out[live])))
    ok_lse = bool(np.all(np.isfinite(lse[live])) and
                  np.all(d_lse <= tol + tol * np.abs(ref_lse[live])))
    ok_empty = bool(np.all(np.isneginf(lse[empty])) and np.all(out[empty] == 0))
    problems = [name for name, ok in (("output", ok_out), ("lse", ok_lse),
                                      ("rows without keys", ok_empty)) if not ok]
    return dict(max_abs_err_out=float(d_out.max(initial=0.0)),
                max_abs_err_lse=float(d_lse.max(initial=0.0)),
                nan=bool(np.isnan(out).any() or np.isnan(lse).any()),
                empty_rows=int(empty.sum()), ok=not problems,
                problem=", ".join(problems) or None)


@functools.cache
def jitted(op: str, impl: str):
    """One jitted function per (entry point, impl), so equal shapes compile once."""
    if op == "attention":
        return jax.jit(lambda q, k, v, m: attention(q, k, v, m, impl=impl))
    # The cache is donated, as the engine donates it: the write happens in place.
    return jax.jit(lambda pages, slots, new: write_kv(pages, slots, new, impl=impl),
                   donate_argnums=0)


def kernel_check(p: Profile, impl: str, kind: str, ctx: int, seed: int, peaks) -> dict:
    case = build_case(p, kind, ctx, seed)
    args = (case.q, case.k_pages, case.v_pages, case.meta)
    kernel, ref = jitted("attention", impl), jitted("attention", "reference")
    out, lse = jax.block_until_ready(kernel(*args))
    ref_out, ref_lse = ref(*args)
    row = dict(impl=impl, kind=kind, context=ctx, seqs=len(case.kv_lens),
               tokens=case.num_tokens, padded_tokens=int(case.q.shape[0]),
               tol=p.tol, **compare(out, lse, ref_out, ref_lse, p.tol))
    del out, lse, ref_out, ref_lse
    tk, tr = timed(kernel, args, p.reps), timed(ref, args, p.reps)
    flops, bytes_ = attention_work(p, case)
    row.update(kernel_ms=tk * 1e3, reference_ms=tr * 1e3, speedup=tr / tk,
               tflops=flops / tk / 1e12, tbps=bytes_ / tk / 1e12,
               flops_of_peak=ratio(flops / tk, peaks[0]), bw_of_peak=ratio(bytes_ / tk, peaks[1]))
    return row


def quantized_kernel_check(p: Profile, impl: str, kv_cache_dtype: str, ctx: int,
                           seed: int) -> dict:
    """The mixed batch over pages stored as ``kv_cache_dtype`` (jserve.kernels.kv_quant):
    the kernel against the reference on the same stored pages (within ``tol``), and its time
    against the same kernel over the full-precision pages."""
    case = build_case(p, "mixed", ctx, seed)
    stored = kv_quant.storage_dtype(kv_cache_dtype, case.k_pages.dtype)

    def pages(x):
        values, scales = kv_quant.quantize(x, stored)
        return values if scales is None else kv_quant.QuantizedPages(values, scales)

    args = (case.q, pages(case.k_pages), pages(case.v_pages), case.meta)
    kernel, ref = jitted("attention", impl), jitted("attention", "reference")
    out, lse = jax.block_until_ready(kernel(*args))
    row = dict(impl=impl, kv_cache_dtype=kv_cache_dtype, context=ctx, tol=p.tol,
               **compare(out, lse, *ref(*args), p.tol))
    del out, lse
    tq = timed(kernel, args, p.reps)
    tf = timed(kernel, (case.q, case.k_pages, case.v_pages, case.meta), p.reps)
    row.update(kernel_ms=tq * 1e3, full_precision_ms=tf * 1e3, speedup=tf / tq)
    return row


def kv_write_check(p: Profile, impl: str, ctx: int, seed: int) -> dict:
    """The backend's cache write against the reference scatter (the mixed batch's slots;
    padding rows go to the sink page 0, which is excluded from the comparison)."""
    case = build_case(p, "mixed", ctx, seed)
    new = jax.random.normal(jax.random.key(seed + 1), (case.q.shape[0], p.hkv, p.d),
                            jnp.float32)
    kernel, ref = jitted("write_kv", impl), jitted("write_kv", "reference")
    out = kernel(jnp.copy(case.k_pages), case.slots, new)
    want = ref(jnp.copy(case.k_pages), case.slots, new)
    same = bool(jnp.array_equal(out[:, 1:], want[:, 1:]))
    mismatched = int(jnp.sum(jnp.any(out[:, 1:] != want[:, 1:], axis=-1)))
    del want

    def in_place(fn, pages):  # each call's output is the next call's (donated) cache
        times = []
        for _ in range(p.reps):
            t0 = time.perf_counter()
            pages = jax.block_until_ready(fn(pages, case.slots, new))
            times.append(time.perf_counter() - t0)
        return pages, statistics.median(times)

    out, tk = in_place(kernel, out)
    out, tr = in_place(ref, out)
    del out
    return dict(impl=impl, context=ctx, tokens=int(case.q.shape[0]), ok=same,
                mismatched_rows=mismatched, kernel_ms=tk * 1e3, reference_ms=tr * 1e3)

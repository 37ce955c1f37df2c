"""The one command to run whenever a GPU or TPU is at hand: kernels, engine and speed.

    python scripts/device_check.py                  # full check on the GPU/TPU (default there)
    python scripts/device_check.py --smoke          # tiny CPU version (default on CPU; CI test)
    python scripts/device_check.py --smoke --write-docs   # ... and write docs/device.{md,json}
    python scripts/device_check.py --skip-timings --contexts 1024,4096   # correctness only

Full mode (the default when ``jax.default_backend()`` is gpu or tpu); every check gets a
status, ``pass`` or ``fail``, and the exit status is non-zero if any failed:

1. Kernels: the backend's Pallas kernel (``pallas_gpu`` on GPU, ``pallas_tpu`` on TPU),
   compiled, against the XLA reference at Llama-3-8B attention shapes (32 query / 8 KV
   heads, head_dim 128, bf16, 16-token pages scattered at random over the pool), contexts
   1K, 4K, 8K, 32K: a decode batch (32 sequences of mixed length up to the context and a
   padding row), a prefill chunk (512 tokens at the end of the context) and a mixed batch
   (16 decodes, a 256-token chunk at the end of the context, a fresh 128-token prompt,
   padding tokens). Output and log-sum-exp must agree within ``|a - b| <= tol + tol |b|``
   (tol 2e-2 in bf16) and rows without keys must come out 0 / -inf in both; ``write_kv``
   must write what the reference scatter writes. Both are timed (median of ``--reps``
   calls after one untimed call, each ended by ``jax.block_until_ready``).
2. Engine: ``LLMEngine`` on random weights with ``attention_impl=<backend kernel>`` against
   ``attention_impl="reference"``, same weights and prompts (mixed lengths, chunked
   prefill, decodes joining and leaving): greedy tokens must be identical. The model is
   float32 and its matmuls run at ``highest`` precision on the accelerator, so the only
   difference between the two runs is the attention implementation (in bf16 a random model's
   near-tied logits would flip on rounding alone); the first mismatch is reported.
3. Timings (not judged) of the engine with the backend kernel on Llama-3.2-1B-shaped and
   Llama-3-8B-shaped random bf16 weights: decode step time at batch 1 and 32 (model bandwidth
   utilisation: bytes of weights + KV read per step / step time / peak bandwidth), prefill
   of a 2K prompt in one chunk (model FLOPs utilisation: model FLOPs / time / peak FLOP/s),
   and a 32K prompt prefilled in 256- vs 2048-token chunks. Step times come from the
   engine's step log (device step plus the token fetch; no host scheduling); every engine
   serves its workload once untimed first (compiles), then once timed.
4. Writes ``docs/device/check.md`` (device, jax version, date, every figure, pass/fail per
   check) and ``--json`` (default ``docs/device/check.json``); ``docs/device.md`` is the
   hand-written account of what the runs showed.

Smoke mode (``--smoke``; the default on CPU): the same code paths at tiny shapes (4 query /
2 KV heads, head_dim 32, float32, contexts 64 and 256, a 2-layer model), both Pallas
flavours run in interpret mode against the reference, the engine with ``pallas_gpu``
(interpreted) against the reference, and timings of a tiny model that are printed but say
nothing about performance. It writes its report to a temporary directory unless
``--write-docs`` is given, so CI never overwrites docs/device/check.md.

Peak figures come from a table keyed by ``jax.devices()[0].device_kind`` (vendor datasheets;
``--peak-tflops`` / ``--peak-tbps`` override it); for an unknown device the utilisations are
n/a.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jserve, installed (maybe elsewhere) or not

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench_kernels import timed  # noqa: E402  (scripts/ is on sys.path when run as a script)
from jserve.config import LlamaConfig  # noqa: E402
from jserve.engine.config import EngineConfig  # noqa: E402
from jserve.engine.engine import LLMEngine  # noqa: E402
from jserve.kernels import AttentionMetadata, attention, kv_quant, resolve_impl, write_kv  # noqa: E402
from jserve.model.weights import init_params, param_shapes  # noqa: E402
from jserve.sampling.params import SamplingParams  # noqa: E402

# (substring of device_kind, dense bf16 FLOP/s, memory bytes/s), first match wins. Vendor
# datasheet figures (SXM parts unless named); an H100 NVL is left unknown (n/a), not guessed.
PEAKS = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100 NVL", None, None),
    ("H100", 989e12, 3.35e12),
    ("A100", 312e12, 2.0e12),
    ("TPU v5 lite", 197e12, 0.819e12),
    ("TPU v5", 459e12, 2.765e12),   # v5p
    ("TPU v6 lite", 918e12, 1.64e12),
    ("TPU v4", 275e12, 1.2e12),
)


# -- settings -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Profile:
    """Everything that differs between the full check and the CPU smoke run."""

    name: str
    # kernel checks
    hq: int
    hkv: int
    d: int
    dtype: str
    page: int
    contexts: tuple[int, ...]
    decode_batch: int
    prefill_chunk: int
    mixed: tuple[int, int, int]     # (decodes, chunk at the end of the context, fresh prompt)
    tol: float
    reps: int
    fixed_shapes: bool              # one pool and table size for every context: one compile
    # engine check
    engine_model: dict
    engine_prompts: tuple[int, ...]
    engine_tokens: tuple[int, ...]  # greedy tokens of each prompt
    engine_kwargs: dict
    # timings
    timing_models: dict
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_tokens: int
    decode_max_model_len: int
    decode_burst: int               # each decode batch again in bursts of this many steps
    prefill_len: int                # one prompt prefilled in one chunk (the MFU figure)
    chunk_context: int              # the long prompt prefilled in chunks of ...
    chunk_sizes: tuple[int, ...]


def llama_cfg(**kw) -> LlamaConfig:
    base = dict(rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                bos_token_id=1, eos_token_ids=(2,))
    return LlamaConfig(**{**base, **kw})


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, tie_word_embeddings=True, dtype="bfloat16")
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, tie_word_embeddings=False, dtype="bfloat16")

FULL = Profile(
    name="full", hq=32, hkv=8, d=128, dtype="bfloat16", page=16,
    contexts=(1024, 4096, 8192, 32768), decode_batch=32, prefill_chunk=512,
    mixed=(16, 256, 128), tol=2e-2, reps=10, fixed_shapes=False,
    # Real attention shapes (32/8 heads, head_dim 128) in a 4-layer float32 model; prompts
    # cross pages, chunks (budget 512) and decode buckets.
    engine_model=dict(vocab_size=32000, hidden_size=2048, intermediate_size=4096,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, tie_word_embeddings=False, dtype="float32"),
    engine_prompts=(7, 100, 513, 1500, 33, 260, 900, 16), engine_tokens=(32,) * 8,
    engine_kwargs=dict(max_num_seqs=8, max_num_batched_tokens=512, max_prefill_seqs=4,
                       max_model_len=2048, page_size=16),
    timing_models={"llama-3.2-1b-shaped": LLAMA_1B, "llama-3-8b-shaped": LLAMA_8B},
    decode_batches=(1, 32), decode_prompt=1024, decode_tokens=64, decode_max_model_len=8192,
    decode_burst=8, prefill_len=2048, chunk_context=32768, chunk_sizes=(256, 2048))

SMOKE = Profile(
    name="smoke", hq=4, hkv=2, d=32, dtype="float32", page=16,
    contexts=(64, 256), decode_batch=4, prefill_chunk=32, mixed=(3, 16, 8), tol=1e-4, reps=3,
    fixed_shapes=True,
    engine_model=dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, tie_word_embeddings=False, dtype="float32"),
    # Budget 32: the first step prefills 5 + 27 tokens, the next mixes a decode with the
    # 13-token rest of the long prompt, then both decode and finish together: a mixed batch
    # in three compiled shapes.
    engine_prompts=(5, 40), engine_tokens=(12, 11),
    engine_kwargs=dict(max_num_seqs=2, max_num_batched_tokens=32, max_prefill_seqs=2,
                       max_model_len=256, page_size=16),
    timing_models={"tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                dtype="float32")},
    # Prompts of 16 (b=1) and 2 x 16 (b=2) prefill in one step each; the 32-token budget
    # engine also serves the 32-token chunks at context 128: five compiled shapes.
    decode_batches=(1, 2), decode_prompt=16, decode_tokens=8, decode_max_model_len=144,
    decode_burst=4, prefill_len=32, chunk_context=128, chunk_sizes=(16, 32))


def peak_figures(device_kind: str, tflops: float | None, tbps: float | None):
    """(FLOP/s, bytes/s) of the device, each None when unknown."""
    flops, bw = next(((f, b) for name, f, b in PEAKS if name in device_kind), (None, None))
    return (tflops * 1e12 if tflops else flops), (tbps * 1e12 if tbps else bw)


# -- helpers ------------------------------------------------------------------------------
def say(msg: str) -> None:
    tqdm.write(msg)
    sys.stdout.flush()


def error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}"[:300]


def free_memory() -> None:
    gc.collect()
    jax.clear_caches()


def ratio(a, b):
    return None if a is None or b is None or not b else a / b


# -- kernel checks ------------------------------------------------------------------------
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
    # The table width is a whole number of the kernels' 4-page KV blocks. With fixed_shapes
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


# -- engine -------------------------------------------------------------------------------
def random_params(cfg: LlamaConfig, seed: int):
    """Random weights like ``init_params`` (normal(0, 0.02) matrices, unit norms) drawn on the
    device: numpy draws for an 8B model take minutes. ``param_shapes`` gives the layout; a
    tiny ``init_params`` of the same depth confirms it still is ``init_params``'s layout
    (else ``init_params`` itself is used, slow but right)."""
    tiny = dataclasses.replace(cfg, vocab_size=16, hidden_size=8, intermediate_size=8,
                               num_attention_heads=cfg.num_key_value_heads, head_dim=2)
    want = init_params(tiny, seed)
    shapes = param_shapes(tiny)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    same = (jax.tree.structure(want) == jax.tree.structure(shapes, is_leaf=is_shape) and
            all(w.shape == s for w, s in zip(jax.tree.leaves(want),
                                             jax.tree.leaves(shapes, is_leaf=is_shape))))
    if not same:
        return init_params(cfg, seed)
    ones = [bool(jnp.all(w == 1)) for w in jax.tree.leaves(want)]
    leaves, treedef = jax.tree.flatten(param_shapes(cfg), is_leaf=is_shape)
    dtype = cfg.np_dtype
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    @functools.partial(jax.jit, static_argnames="shape")
    def normal(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    out = [jnp.ones(s, dtype) if one else normal(k, shape=s)
           for s, one, k in zip(leaves, ones, keys)]
    return jax.tree.unflatten(treedef, out)


def make_engine(cfg, params, impl: str, **kwargs) -> LLMEngine:
    # No prefix cache: ``twice`` serves the same prompts again, and a timed run that finds
    # them cached measures one short chunk (and its compile), not the prefill.
    return LLMEngine(cfg, params, None, EngineConfig(
        attention_impl=impl, warmup=False, enable_prefix_caching=False, **kwargs))


def serve(engine: LLMEngine, prompts, params, desc: str):
    """Runs prompts to completion like ``LLM.generate`` (``params``: one SamplingParams or
    one per prompt); returns (outputs in prompt order, step log [(plan, seconds)], compiles
    during the run). Failed requests raise."""
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = engine.add_requests(prompts, params)
    engine.step_log = []
    compiles = engine.compile_count
    done = {}
    with tqdm(total=sum(x.max_tokens for x in params), desc=desc, unit="tok", leave=False,
              disable=None) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(len(out.token_ids))
    outs = [done[i] for i in ids]
    bad = [o for o in outs if o.error or o.finish_reason == "abort"]
    if bad:
        raise RuntimeError(f"{desc}: request {bad[0].request_id} failed: {bad[0].error}")
    log, engine.step_log = engine.step_log, None
    return outs, log, engine.compile_count - compiles


def engine_check(p: Profile, impl: str, seed: int) -> dict:
    cfg = llama_cfg(**p.engine_model)
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in p.engine_prompts]
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in p.engine_tokens]
    # On an accelerator, float32 matmuls default to reduced precision (TF32 / one bf16 pass):
    # at "highest" both runs compute the same model and differ only in attention.
    precise = (jax.default_matmul_precision("highest") if jax.default_backend() != "cpu"
               else contextlib.nullcontext())
    tokens, secs = {}, {}
    with precise:
        for name in ("reference", impl):
            t0 = time.perf_counter()
            engine = make_engine(cfg, params, name, **p.engine_kwargs)
            outs, _, _ = serve(engine, prompts, greedy, f"engine {name}")
            secs[name] = time.perf_counter() - t0
            tokens[name] = [list(o.token_ids) for o in outs]
            del engine
            free_memory()
    ref, got = tokens["reference"], tokens[impl]
    compared = sum(min(len(a), len(b)) for a, b in zip(ref, got))
    mismatch = None
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatch = dict(request=i, prompt_len=len(prompts[i]), token=k,
                            reference=a[k:k + 5], kernel=b[k:k + 5])
            break
    full_length = all(len(a) == len(b) == n for a, b, n in zip(ref, got, p.engine_tokens))
    return dict(impl=impl, model=p.engine_model, prompts=list(p.engine_prompts),
                engine=p.engine_kwargs, max_tokens=list(p.engine_tokens), tokens_compared=compared,
                identical=mismatch is None and full_length, first_mismatch=mismatch,
                reference_s=secs["reference"], kernel_s=secs[impl],
                ok=mismatch is None and full_length)


# -- timings ------------------------------------------------------------------------------
def weight_bytes_read(cfg: LlamaConfig) -> float:
    """Weights a decode step reads: every layer, the final norm and the LM head (the
    embedding table only when it is the head: a lookup reads a few rows)."""
    shapes = param_shapes(cfg)
    n = sum(math.prod(s) for s in jax.tree.leaves(shapes["layers"],
                                                  is_leaf=lambda x: isinstance(x, tuple)))
    n += cfg.hidden_size + cfg.vocab_size * cfg.hidden_size
    return float(n * cfg.np_dtype.itemsize)


def matmul_params_per_token(cfg: LlamaConfig) -> int:
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return cfg.num_hidden_layers * (2 * d * q + 2 * d * kv + 3 * d * f)


def kv_bytes_per_token(cfg: LlamaConfig) -> int:
    return (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
            * cfg.np_dtype.itemsize)


def prefill_flops(cfg: LlamaConfig, prompt_len: int) -> float:
    """Model FLOPs of prefilling one prompt: the layers' matmuls for every token, causal
    attention (QK^T and PV) for every (query, earlier key) pair, and the LM head once (the
    sampled token)."""
    pairs = prompt_len * (prompt_len + 1) / 2
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs
    return (2.0 * matmul_params_per_token(cfg) * prompt_len + attn
            + 2.0 * cfg.hidden_size * cfg.vocab_size)


def twice(engine, prompts, params, desc):
    """Serve once untimed (compiles every shape the workload meets), then once timed."""
    serve(engine, prompts, params, f"{desc} (warm-up)")
    return serve(engine, prompts, params, desc)


def decode_timing(p: Profile, name: str, cfg, engine, impl: str, peaks, b: int,
                  rng: np.random.Generator, burst: int = 1) -> dict:
    """Batch b of ``decode_prompt``-token prompts, ``decode_tokens`` greedy tokens each: the
    step times of the steps where all b sequences decode and nothing prefills. ``burst`` > 1:
    with decode bursts of that many steps (``EngineConfig.decode_burst``), the times of the
    bursts over their steps."""
    prompts = rng.integers(3, cfg.vocab_size, (b, p.decode_prompt)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=p.decode_tokens, ignore_eos=True)
    engine.bursts.steps = burst
    try:
        _, log, compiles = twice(engine, prompts, greedy,
                                 f"{name} decode b={b}" + (f" bursts of {burst}" if burst > 1
                                                           else ""))
    finally:
        engine.bursts.steps = 1
    steps = [(plan, s / plan.burst) for plan, s in log
             if not plan.prefills and len(plan.decodes) == b and plan.burst == burst]
    if not steps:
        raise RuntimeError(f"no step had all {b} sequences decoding")
    # Context a decode attends to: its position + 1 (ScheduledChunk.start; if the plan
    # stops saying, the mean over the decode phase).
    approx = b * (p.decode_prompt + p.decode_tokens / 2)
    ctx = statistics.mean(
        sum(c.start + 1 for c in plan.decodes)
        if all(hasattr(c, "start") for c in plan.decodes) else approx for plan, _ in steps)
    step = statistics.median(s for _, s in steps)
    w_bytes = weight_bytes_read(cfg)
    kv = ctx * kv_bytes_per_token(cfg)
    row = dict(model=name, impl=impl, batch=b, burst=burst, prompt=p.decode_prompt,
               new_tokens=p.decode_tokens, max_model_len=engine.max_model_len,
               steps_timed=len(steps), mean_context=ctx / b, step_ms=step * 1e3,
               tok_s=b / step, weight_gb=w_bytes / 1e9, kv_gb=kv / 1e9,
               tbps=(w_bytes + kv) / step / 1e12, mbu=ratio((w_bytes + kv) / step, peaks[1]),
               compiles_while_timed=compiles)
    say(f"  decode {name} b={b} burst {burst}: {row['step_ms']:.2f} ms/step, "
        f"{row['tok_s']:.1f} tok/s, "
        f"{row['tbps']:.3g} TB/s, MBU {fmt_pct(row['mbu'])}")
    return row


def prefill_timing(p: Profile, name: str, cfg, engine, impl: str, peaks, prompt_len: int,
                   chunk: int, rng: np.random.Generator) -> dict:
    """One prompt of ``prompt_len`` tokens, one new token, chunks of ``chunk`` tokens (the
    engine's token budget): the summed step times of its prefill."""
    prompt = rng.integers(3, cfg.vocab_size, prompt_len).tolist()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    _, log, compiles = twice(engine, [prompt], one, f"{name} prefill {prompt_len}/{chunk}")
    secs = sum(s for _, s in log)
    flops = prefill_flops(cfg, prompt_len)
    row = dict(model=name, impl=impl, prompt=prompt_len, chunk=chunk, steps=len(log),
               seconds=secs, tok_s=prompt_len / secs, tflops=flops / secs / 1e12,
               mfu=ratio(flops / secs, peaks[0]), compiles_while_timed=compiles)
    say(f"  prefill {name} {prompt_len} tokens in chunks of {chunk}: {secs * 1e3:.1f} ms, "
        f"{row['tok_s']:.0f} tok/s, {row['tflops']:.3g} TFLOP/s, MFU {fmt_pct(row['mfu'])}")
    return row


def model_timings(p: Profile, name: str, impl: str, peaks, seed: int, out: dict) -> None:
    """Every figure of one model into ``out``; a failed measurement is recorded in
    ``out["errors"]`` and the others still run."""
    cfg = llama_cfg(**p.timing_models[name])
    say(f"timings: {name} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, head_dim {cfg.head_dim}, "
        f"{cfg.dtype}, attention {impl})")

    def attempt(what, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the other figures still run
            traceback.print_exc()
            out["errors"].append(f"{name} {what}: {error_text(e)}")
            say(f"  {name} {what} failed: {error_text(e)}")
            return None

    params = attempt("weights", lambda: random_params(cfg, seed))
    if params is None:
        return
    rng = np.random.default_rng(seed)
    pages = lambda n: -(-n // p.page)  # noqa: E731
    long_len = p.chunk_context + p.page
    # The decode engine (token budget prefill_len) also serves the big-chunk prefill at long
    # context when its max_model_len allows: one engine, fewer compiles.
    reuse = p.decode_max_model_len >= long_len
    need = max(max(p.decode_batches) * pages(p.decode_prompt + p.decode_tokens),
               pages(p.prefill_len) + 1, pages(long_len) + 1 if reuse else 0)
    engine = attempt("engine", lambda: make_engine(
        cfg, params, impl, max_num_seqs=max(p.decode_batches),
        max_num_batched_tokens=p.prefill_len, max_prefill_seqs=4,
        max_model_len=p.decode_max_model_len, page_size=p.page, num_kv_pages=need + 2))
    if engine is not None:
        for b in p.decode_batches:
            for burst in (1, p.decode_burst):
                row = attempt(f"decode b={b} burst {burst}", lambda b=b, burst=burst:
                              decode_timing(p, name, cfg, engine, impl, peaks, b, rng, burst))
                if row:
                    out["decode"].append(row)
        row = attempt(f"prefill {p.prefill_len}", lambda: prefill_timing(
            p, name, cfg, engine, impl, peaks, p.prefill_len, p.prefill_len, rng))
        if row:
            out["prefill"].append(row)
    chunks = {}
    # The chunk the decode engine can serve first, then drop that engine.
    for chunk in sorted(p.chunk_sizes, key=lambda c: not (reuse and c == p.prefill_len)):
        def run(chunk=chunk):
            # Reads `engine` when it runs, after it may have been dropped (so its pool is freed).
            eng = (engine if reuse and engine is not None and chunk == p.prefill_len else  # noqa: B023
                   make_engine(cfg, params, impl, max_num_seqs=1, max_num_batched_tokens=chunk,
                               max_prefill_seqs=1, max_model_len=long_len, page_size=p.page,
                               num_kv_pages=pages(long_len) + 3))
            return prefill_timing(p, name, cfg, eng, impl, peaks, p.chunk_context, chunk, rng)
        if chunk != p.prefill_len or not reuse:
            engine = None  # the decode engine's pool goes before a new one is allocated
            free_memory()
        row = attempt(f"prefill {p.chunk_context} in chunks of {chunk}", run)
        free_memory()
        if row:
            out["prefill"].append(row)
            chunks[chunk] = row
    if len(chunks) >= 2:
        lo, hi = min(chunks), max(chunks)
        out["chunked"].append(dict(model=name, context=p.chunk_context, small_chunk=lo,
                                   big_chunk=hi, small_s=chunks[lo]["seconds"],
                                   big_s=chunks[hi]["seconds"],
                                   slowdown=chunks[lo]["seconds"] / chunks[hi]["seconds"]))


def timings(p: Profile, impl: str, peaks, seed: int, models: list[str]) -> dict:
    out = dict(impl=impl, decode=[], prefill=[], chunked=[], errors=[])
    for name in models:
        model_timings(p, name, impl, peaks, seed, out)
        free_memory()
    return out


# -- report -------------------------------------------------------------------------------
def fmt_pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def fmt(x, digits=3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |"
              for r in rows]
    return "\n".join(lines)


def render_markdown(res: dict) -> str:
    smoke = res["mode"] == "smoke"
    peaks = res["peaks"]
    out = [f"# Device check: {res['device_kind']}", ""]
    out.append(f"Written by `{res['command']}` on {res['date']} (jax {res['jax_version']}, "
               f"backend {res['backend']}, {res['mode']} mode, {res['wall_s']:.0f} s). "
               f"Overall: **{'PASS' if res['passed'] else 'FAIL'}**.")
    out.append("")
    if smoke:
        out.append("Smoke mode: tiny shapes, Pallas kernels interpreted on the CPU. The checks "
                   "are real; the times measure the interpreter and the CPU, not a kernel.")
        out.append("")
    out.append(f"Peak figures ({res['device_kind']}): "
               f"{fmt(peaks['tflops'])} TFLOP/s dense bf16, {fmt(peaks['tbps'])} TB/s"
               + (" (n/a: not in the script's table; pass --peak-tflops/--peak-tbps)."
                  if peaks["tflops"] is None or peaks["tbps"] is None else " (datasheet)."))
    out += ["", "## Checks", ""]
    out.append(md_table(["check", "status", "detail"],
                        [[c["name"], c["status"], c.get("detail") or ""] for c in res["checks"]]))
    if res.get("kernels"):
        s = res["shapes"]
        out += ["", "## Kernels against the reference", "",
                f"{s['hq']} query / {s['hkv']} KV heads, head_dim {s['d']}, {s['dtype']}, "
                f"{s['page']}-token pages scattered over the pool; pass: "
                f"`|kernel - reference| <= tol + tol * |reference|` on output and lse, rows "
                f"without keys 0 / -inf. Times: median of {res['reps']} calls. TB/s: K and V "
                f"of every live sequence read once, Q read and O written once; TFLOP/s: QK^T "
                f"and PV of every attended pair.", ""]
        out.append(md_table(
            ["impl", "batch", "context", "seqs", "tokens", "max abs err out",
             "max abs err lse", "tol", "status", "kernel ms", "reference ms", "speedup",
             "TB/s", "% peak BW", "TFLOP/s", "% peak FLOP/s"],
            [[r["impl"], r["kind"], r["context"], r.get("seqs"), r.get("tokens"),
              r.get("max_abs_err_out"), r.get("max_abs_err_lse"), r.get("tol"), r["status"],
              r.get("kernel_ms"), r.get("reference_ms"), r.get("speedup"), r.get("tbps"),
              fmt_pct(r.get("bw_of_peak")), r.get("tflops"), fmt_pct(r.get("flops_of_peak"))]
             for r in res["kernels"]]))
    if res.get("kv_write"):
        out += ["", "### Cache write (`write_kv`) against the reference scatter", "",
                "The mixed batch's new K rows written into its pool; equal outside the sink "
                "page 0. Times: the cache donated (in place, as in the engine), median of "
                f"{res['reps']} calls.", ""]
        out.append(md_table(["impl", "context", "tokens", "status", "kernel ms",
                             "reference ms"],
                            [[r["impl"], r["context"], r.get("tokens"), r["status"],
                              r.get("kernel_ms"), r.get("reference_ms")]
                             for r in res["kv_write"]]))
    if res.get("kernels_quantized"):
        out += ["", "### Quantized KV pages (docs/quantization.md)", "",
                "The mixed batch over pages stored int8 (per token and head scales) or "
                "fp8_e4m3: the kernel against the reference on the same stored pages, and its "
                "time against the same kernel over the full-precision pages.", ""]
        out.append(md_table(["impl", "kv cache", "context", "max abs err out", "tol",
                             "status", "kernel ms", "full-precision ms", "speedup"],
                            [[r["impl"], r.get("kv_cache_dtype"), r["context"],
                              r.get("max_abs_err_out"), r.get("tol"), r["status"],
                              r.get("kernel_ms"), r.get("full_precision_ms"),
                              r.get("speedup")] for r in res["kernels_quantized"]]))
    e = res.get("engine")
    if e:
        m = e.get("model", {})
        out += ["", "## Engine: greedy tokens, kernel vs reference", "",
                f"Random float32 model ({m.get('num_hidden_layers')} layers, hidden "
                f"{m.get('hidden_size')}, {m.get('num_attention_heads')}/"
                f"{m.get('num_key_value_heads')} heads, head_dim {m.get('head_dim')}); prompts "
                f"of {e.get('prompts')} tokens, {e.get('max_tokens')} greedy tokens each; "
                f"engine `{json.dumps(e.get('engine'))}`.", ""]
        out.append(md_table(["attention_impl", "tokens compared", "identical",
                             "first mismatch", "kernel run s", "reference run s"],
                            [[e.get("impl", "?"), e.get("tokens_compared"), e.get("identical"),
                              json.dumps(e.get("first_mismatch")) if e.get("first_mismatch")
                              else "none", e.get("kernel_s"), e.get("reference_s")]]))
    t = res.get("timings")
    if t:
        out += ["", f"## Engine timings (attention_impl={t['impl']}, random weights)", "",
                "Step times from the engine's step log (device step plus token fetch), median "
                "over the steps where the whole batch decodes (burst > 1: decode bursts of "
                "that many steps, a burst's time over its steps). MBU = (weights read + KV read) "
                "per step / step time / peak bandwidth; MFU = model FLOPs (layer matmuls per "
                "token, causal attention, LM head once) / prefill time / peak FLOP/s.", "",
                "### Decode", ""]
        out.append(md_table(
            ["model", "batch", "burst", "prompt", "new tokens", "max_model_len",
             "mean context", "step ms", "tok/s", "weights GB", "KV GB/step", "TB/s", "MBU"],
            [[r["model"], r["batch"], r.get("burst", 1), r["prompt"], r["new_tokens"],
              r["max_model_len"],
              r["mean_context"], r["step_ms"], r["tok_s"], r["weight_gb"], r["kv_gb"],
              r["tbps"], fmt_pct(r["mbu"])] for r in t["decode"]]))
        out += ["", "### Prefill", ""]
        out.append(md_table(
            ["model", "prompt", "chunk", "steps", "seconds", "tok/s", "TFLOP/s", "MFU"],
            [[r["model"], r["prompt"], r["chunk"], r["steps"], r["seconds"], r["tok_s"],
              r["tflops"], fmt_pct(r["mfu"])] for r in t["prefill"]]))
        out += ["", "### Small vs large chunks at long context", ""]
        out.append(md_table(
            ["model", "context", "chunk", "seconds", "vs chunk", "seconds", "slowdown"],
            [[r["model"], r["context"], r["small_chunk"], r["small_s"], r["big_chunk"],
              r["big_s"], r["slowdown"]] for r in t["chunked"]]))
    errors = [c for c in res["checks"] if c["status"] == "fail"]
    if errors:
        out += ["", "## Failures", ""]
        out += [f"- {c['name']}: {c.get('detail')}" for c in errors]
    out.append("")
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true",
                      help="tiny shapes, interpreted kernels (default when the backend is cpu)")
    mode.add_argument("--full", action="store_true",
                      help="real shapes (default when the backend is gpu or tpu)")
    ap.add_argument("--impl", default="auto",
                    help="kernel to check and time: auto is the backend's Pallas kernel; in "
                         "smoke mode auto checks both flavours interpreted, runs the engine "
                         "with pallas_gpu and times the reference")
    ap.add_argument("--contexts", default=None,
                    help="comma-separated kernel-check contexts; unset: "
                         f"{','.join(map(str, FULL.contexts))} (smoke "
                         f"{','.join(map(str, SMOKE.contexts))})")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed calls per kernel figure; unset: {FULL.reps} ({SMOKE.reps} in "
                         "smoke mode)")
    ap.add_argument("--models", default=None,
                    help="comma-separated timing models; unset: "
                         f"{','.join(FULL.timing_models)} (smoke: "
                         f"{','.join(SMOKE.timing_models)})")
    ap.add_argument("--skip-kernels", action="store_true", help="no kernel checks")
    ap.add_argument("--skip-engine", action="store_true", help="no engine token check")
    ap.add_argument("--skip-timings", action="store_true", help="no engine timings")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="override the device's peak dense bf16 TFLOP/s")
    ap.add_argument("--peak-tbps", type=float, default=None,
                    help="override the device's peak memory bandwidth, TB/s")
    ap.add_argument("--seed", type=int, default=0, help="seeds weights, prompts and cases")
    ap.add_argument("--json", type=Path, default=None,
                    help="results JSON; unset: docs/device/check.json in full mode or with "
                         "--write-docs, else in a new temporary directory")
    ap.add_argument("--md", type=Path, default=None,
                    help="report markdown; unset: docs/device/check.md in full mode or with "
                         "--write-docs, else next to the JSON (smoke)")
    ap.add_argument("--write-docs", action="store_true",
                    help="smoke mode: write docs/device/check.md and check.json too")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    backend = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    smoke = args.smoke or (not args.full and backend not in ("gpu", "tpu"))
    p = SMOKE if smoke else FULL
    if args.contexts:
        p = dataclasses.replace(p, contexts=tuple(int(c) for c in args.contexts.split(",")))
    if args.reps:
        p = dataclasses.replace(p, reps=args.reps)
    if smoke and args.impl == "auto":
        kernel_impls, engine_impl = ["pallas_gpu", "pallas_tpu"], "pallas_gpu"
        timing_impl = resolve_impl("auto")
    else:
        impl = resolve_impl(args.impl)
        if impl == "reference":
            print(f"no Pallas kernel for backend {backend!r}: pass --impl pallas_gpu or "
                  f"pallas_tpu (interpreted, very slow at full shapes) or use --smoke",
                  file=sys.stderr)
            return 2
        kernel_impls, engine_impl, timing_impl = [impl], impl, impl
    models = args.models.split(",") if args.models else list(p.timing_models)
    unknown = sorted(set(models) - set(p.timing_models))
    if unknown:
        print(f"unknown models {unknown}; this mode has {list(p.timing_models)}",
              file=sys.stderr)
        return 2
    to_docs = not smoke or args.write_docs  # smoke runs (CI) keep off docs/ unless asked
    json_path = args.json or (ROOT / "docs" / "device" / "check.json" if to_docs else
                              Path(tempfile.mkdtemp(prefix="device-check-")) / "device.json")
    md_path = args.md or (ROOT / "docs" / "device" / "check.md" if to_docs else
                          json_path.with_suffix(".md"))
    flops_peak, bw_peak = peak_figures(device_kind, args.peak_tflops, args.peak_tbps)
    peaks = (flops_peak, bw_peak)
    # The engine's persistent compilation cache, on from the start so the kernel checks'
    # compiles are kept too (a rerun skips them).
    cache_dir = EngineConfig().compilation_cache_dir
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    say(f"device check ({p.name}): backend={backend} device={device_kind} jax={jax.__version__}"
        f" kernels={kernel_impls} engine={engine_impl} timings={timing_impl} peaks="
        f"{fmt(ratio(flops_peak, 1e12))} TFLOP/s, {fmt(ratio(bw_peak, 1e12))} TB/s")

    res: dict = dict(
        mode=p.name, backend=backend, device_kind=device_kind, jax_version=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join(["python scripts/device_check.py",
                          *(sys.argv[1:] if argv is None else argv)]),
        peaks=dict(tflops=ratio(flops_peak, 1e12), tbps=ratio(bw_peak, 1e12)),
        shapes=dict(hq=p.hq, hkv=p.hkv, d=p.d, dtype=p.dtype, page=p.page), reps=p.reps,
        checks=[], kernels=[], kv_write=[], kernels_quantized=[])
    checks = res["checks"]

    def record(name: str, ok: bool, detail: str | None = None, **extra) -> None:
        checks.append(dict(name=name, status="pass" if ok else "fail", detail=detail, **extra))
        say(f"[{'pass' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))

    # 1. kernels
    if not args.skip_kernels:
        cases = [(impl, kind, ctx) for impl in kernel_impls for ctx in p.contexts
                 for kind in ("decode", "prefill", "mixed")]
        cases += [(impl, "write_kv", ctx) for impl in kernel_impls for ctx in p.contexts]
        # Quantized KV pages (docs/quantization.md): the mixed batch at the longest context.
        cases += [(impl, f"mixed {kv}", max(p.contexts)) for impl in kernel_impls
                  for kv in ("int8", "fp8_e4m3")]
        for n, (impl, kind, ctx) in enumerate(tqdm(cases, desc="kernels", disable=None)):
            name = f"kernel {impl} {kind} context {ctx}"
            seed = args.seed * 1000 + ctx + n
            try:
                if kind.startswith("mixed "):
                    row = quantized_kernel_check(p, impl, kind.split()[1], ctx, seed)
                    detail = (f"max abs err out {row['max_abs_err_out']:.2e} (tol {p.tol:g}); "
                              f"{row['kernel_ms']:.3g} ms vs {row['full_precision_ms']:.3g} ms "
                              f"over full-precision pages")
                    res["kernels_quantized"].append(row)
                elif kind == "write_kv":
                    row = kv_write_check(p, impl, ctx, seed)
                    detail = (f"{row['mismatched_rows']} rows differ" if not row["ok"] else
                              f"{row['kernel_ms']:.3g} ms vs {row['reference_ms']:.3g} ms")
                    res["kv_write"].append(row)
                else:
                    row = kernel_check(p, impl, kind, ctx, seed, peaks)
                    detail = (f"max abs err out {row['max_abs_err_out']:.2e}, lse "
                              f"{row['max_abs_err_lse']:.2e} (tol {p.tol:g}); "
                              f"{row['kernel_ms']:.3g} ms vs reference "
                              f"{row['reference_ms']:.3g} ms")
                    if not row["ok"]:
                        detail = f"{row['problem']} out of tolerance; " + detail
                    res["kernels"].append(row)
                row["status"] = "pass" if row["ok"] else "fail"
                record(name, row["ok"], detail)
            except Exception as e:  # noqa: BLE001 - one failure must not hide the others
                traceback.print_exc()
                (res["kv_write"] if kind == "write_kv" else res["kernels_quantized"]
                 if kind.startswith("mixed ") else res["kernels"]).append(
                    dict(impl=impl, kind=kind, context=ctx, status="fail",
                         error=error_text(e)))
                record(name, False, error_text(e))
            gc.collect()  # the case's cache pool (compiled kernels stay: shapes repeat)
        free_memory()

    # 2. engine
    if not args.skip_engine:
        name = f"engine greedy tokens {engine_impl} vs reference"
        try:
            e = engine_check(p, engine_impl, args.seed)
            res["engine"] = e
            detail = (f"{e['tokens_compared']} tokens identical" if e["ok"] else
                      f"first mismatch {e['first_mismatch']}" if e["first_mismatch"] else
                      "outputs shorter than max_tokens")
            record(name, e["ok"], detail, tokens_compared=e["tokens_compared"])
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["engine"] = dict(impl=engine_impl, error=error_text(e), tokens_compared=0)
            record(name, False, error_text(e), tokens_compared=0)
        free_memory()

    # 3. timings
    if not args.skip_timings:
        name = f"engine timings ran ({', '.join(models)}; {timing_impl})"
        try:
            t = res["timings"] = timings(p, timing_impl, peaks, args.seed, models)
            record(name, not t["errors"],
                   "; ".join(t["errors"][:3]) if t["errors"] else
                   "figures are not judged" + ("; in smoke mode they say nothing about speed"
                                               if smoke else ""))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(name, False, error_text(e))
        free_memory()

    res["passed"] = all(c["status"] == "pass" for c in checks)
    res["wall_s"] = time.perf_counter() - t_start
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    md_path.write_text(render_markdown(res))
    n_fail = sum(c["status"] == "fail" for c in checks)
    say(f"{len(checks) - n_fail}/{len(checks)} checks passed in {res['wall_s']:.1f} s; "
        f"wrote {json_path} and {md_path}")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

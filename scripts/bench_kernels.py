"""Pallas attention kernels against the XLA reference, on the accelerator this runs on.

    python scripts/bench_kernels.py                 # full grid (GPU or TPU; tens of minutes)
    python scripts/bench_kernels.py --sanity        # tiny interpreted cases (the default on CPU)
    python scripts/bench_kernels.py --cpu           # the native CPU kernels (jserve.kernels.cpu)
    python scripts/bench_kernels.py --out kernels.json --peak-tflops 989 --peak-tbps 3.35

What it measures (Llama-3-8B attention shapes: 32 query / 8 KV heads, head_dim 128, bf16,
16-token pages scattered at random over the pool; every time is the median of ``--reps``
calls after one untimed call, each call ended by ``block_until_ready``):

1. Prefill: one sequence's chunk of 32..2048 tokens at a context (KV, chunk included) of
   4K..128K tokens.
2. Decode: batch 1..128 of single tokens at a context of 4K..1M tokens each; cells whose KV
   exceeds ``--kv-budget-gib`` are skipped (pages are never shared between sequences: shared
   pages would be served from L2 and flatter the bandwidth).
3. Medha's ratio at 1M context: attention time per prompt token of 32-token chunks over that
   of 2048-token chunks (how much small chunks cost at long context).

For each cell: kernel time, reference time and their ratio; achieved FLOP/s (4 x head_dim x
query heads per attended key-query pair: QK^T and PV) and bytes/s (the compulsory traffic:
every attended K and V row read once, Q read and the output written once), each also as a
fraction of the device's peak (a table below for known GPUs, else ``--peak-*``).

``--cpu`` times the native CPU kernels against the reference on the 12-layer bench
checkpoint's heads (12 query / 4 KV, head_dim 64, float32): prefill chunks of 512 and 2048
tokens at 1K-4K of context, and a batch of 32 decodes at 1K.

``--sanity`` runs a few tiny cases with the kernels interpreted, checks them against the
reference and prints times that say nothing about performance (interpreter overhead only).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from harness.kernel_check import timed
from jserve.kernels import AttentionMetadata, attention, resolve_impl
from jserve.kernels.reference import PAGES_PER_BLOCK

PAGE = 16
# Dense bf16 tensor-core FLOP/s and HBM bytes/s (vendor datasheets, SXM parts).
PEAKS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12)}
PREFILL_CHUNKS = (32, 128, 512, 2048)
PREFILL_KV = (4096, 16384, 65536, 131072)
DECODE_BATCH = (1, 8, 32, 128)
DECODE_KV = (4096, 32768, 131072, 1 << 20)


@dataclasses.dataclass(frozen=True)
class Heads:
    hq: int = 32
    hkv: int = 8
    d: int = 128
    dtype: type = jnp.bfloat16


LLAMA3_8B = Heads()


def make_case(n_seqs: int, kv_len: int, chunk: int, heads: Heads, page=PAGE, seed=0):
    """n_seqs sequences of context kv_len, each with ``chunk`` new tokens (1: decodes)."""
    hq, hkv, d, dtype = heads.hq, heads.hkv, heads.d, heads.dtype
    rng = np.random.default_rng(seed)
    per_seq = -(-kv_len // page)
    width = -(-per_seq // PAGES_PER_BLOCK) * PAGES_PER_BLOCK
    num_pages = 1 + n_seqs * per_seq
    table = np.zeros((n_seqs, width), np.int32)
    table[:, :per_seq] = 1 + rng.permutation(n_seqs * per_seq).reshape(n_seqs, per_seq)
    positions = np.tile(np.arange(kv_len - chunk, kv_len, dtype=np.int32), n_seqs)
    decode = chunk == 1
    meta = AttentionMetadata(
        positions=jnp.asarray(positions),
        token_seq=jnp.asarray(np.repeat(np.arange(n_seqs, dtype=np.int32), chunk)),
        kv_lens=jnp.full((n_seqs,), kv_len, jnp.int32), page_table=jnp.asarray(table),
        num_prefills=jnp.asarray(0 if decode else n_seqs, jnp.int32),
        num_decodes=n_seqs if decode else 0)
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (n_seqs * chunk, hq, d), dtype)
    k = jax.random.normal(keys[1], (hkv, num_pages, page, d), dtype)
    v = jax.random.normal(keys[2], (hkv, num_pages, page, d), dtype)
    return q, k, v, meta


def work(n_seqs, kv_len, chunk, heads: Heads):
    """(FLOPs, compulsory bytes) of one call."""
    pairs = n_seqs * sum(kv_len - chunk + i + 1 for i in range(chunk))
    flops = 4 * heads.d * heads.hq * pairs
    rows = 2 * heads.hkv * n_seqs * kv_len + 2 * heads.hq * n_seqs * chunk
    return flops, jnp.dtype(heads.dtype).itemsize * heads.d * rows


def run_cell(kind, n_seqs, kv_len, chunk, impl, reps, peaks, heads=LLAMA3_8B):
    args = make_case(n_seqs, kv_len, chunk, heads)
    kernel = jax.jit(lambda q, k, v, m: attention(q, k, v, m, impl=impl))
    ref = jax.jit(lambda q, k, v, m: attention(q, k, v, m, impl="reference"))
    tk, tr = timed(kernel, args, reps), timed(ref, args, reps)
    flops, bytes_ = work(n_seqs, kv_len, chunk, heads)
    row = dict(impl=impl, kind=kind, batch=n_seqs, kv=kv_len, chunk=chunk, kernel_s=tk,
               reference_s=tr, speedup=tr / tk, tflops=flops / tk / 1e12, tbps=bytes_ / tk / 1e12)
    if peaks:
        row.update(flops_of_peak=flops / tk / peaks[0], bytes_of_peak=bytes_ / tk / peaks[1])
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in row.items()), flush=True)
    del args
    return row


def full(impl, reps, peaks, budget_bytes):
    rows = []
    for kv in PREFILL_KV:
        for chunk in PREFILL_CHUNKS:
            rows.append(run_cell("prefill", 1, kv, chunk, impl, reps, peaks))
    kv_row = work(1, 1, 1, LLAMA3_8B)[1]  # bytes of K and V per token (and one query)
    for kv in DECODE_KV:
        for batch in DECODE_BATCH:
            if batch * kv * kv_row > budget_bytes:
                print(f"kind=decode batch={batch} kv={kv} skipped: KV over the budget")
                continue
            rows.append(run_cell("decode", batch, kv, 1, impl, reps, peaks))
    medha = {c: run_cell("prefill", 1, 1 << 20, c, impl, reps, peaks) for c in (32, 2048)}
    ratio = (medha[32]["kernel_s"] / 32) / (medha[2048]["kernel_s"] / 2048)
    print(f"medha_ratio_1M (time per token, 32-token chunk / 2048-token chunk) = {ratio:.3g}")
    return dict(rows=rows, medha_ratio_1m=ratio)


BENCH_HEADS = Heads(hq=12, hkv=4, d=64, dtype=jnp.float32)
CPU_CELLS = (("prefill", 1, 1024, 512), ("prefill", 1, 4096, 512), ("prefill", 1, 4096, 2048),
             ("decode", 32, 1024, 1))


def cpu(reps):
    """The native CPU kernels (``impl="cpu"``) against the reference on ``CPU_CELLS``."""
    return dict(rows=[run_cell(kind, n, kv, chunk, "cpu", reps, None, BENCH_HEADS)
                      for kind, n, kv, chunk in CPU_CELLS])


def sanity(impls):
    """Tiny cases with the kernels interpreted: correctness and plumbing, no performance."""
    heads = Heads(hq=8, hkv=2, d=64, dtype=jnp.float32)
    rows = []
    for impl in impls:
        for kind, n, kv, chunk in (("prefill", 1, 300, 32), ("decode", 4, 500, 1)):
            q, k, v, meta = make_case(n, kv, chunk, heads)
            out, lse = attention(q, k, v, meta, impl=impl)
            ref_out, ref_lse = attention(q, k, v, meta, impl="reference")
            err = float(jnp.abs(out - ref_out).max())
            assert err < 1e-4 and float(jnp.abs(lse - ref_lse).max()) < 1e-4, (impl, kind, err)
            row = run_cell(kind, n, kv, chunk, impl, 2, None, heads)
            rows.append(dict(row, max_abs_err=err))
    return dict(rows=rows, note="interpreted kernels on CPU: times are not performance")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sanity", action="store_true", help="tiny interpreted cases only")
    ap.add_argument("--cpu", action="store_true", help="the native CPU kernels")
    ap.add_argument("--impl", default="auto", help="kernel to time (default: the backend's)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kv-budget-gib", type=float, default=32.0)
    ap.add_argument("--peak-tflops", type=float, help="peak FLOP/s of this device, in T")
    ap.add_argument("--peak-tbps", type=float, help="peak memory bytes/s, in TB/s")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    backend = jax.default_backend()
    impl = resolve_impl(args.impl)
    device = jax.devices()[0].device_kind
    print(f"backend={backend} device={device}")
    if args.cpu:
        impl = "cpu"
        result = cpu(args.reps)
    elif args.sanity or backend == "cpu":
        result = sanity(["pallas_gpu", "pallas_tpu"] if args.impl == "auto" else [impl])
    else:
        if impl == "reference":
            raise SystemExit("no Pallas kernel for this backend; pass --impl")
        peaks = next((p for name, p in PEAKS.items() if name in device), None)
        if args.peak_tflops and args.peak_tbps:
            peaks = (args.peak_tflops * 1e12, args.peak_tbps * 1e12)
        result = full(impl, args.reps, peaks, args.kv_budget_gib * 2**30)
    result.update(backend=backend, device=device, impl=impl)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

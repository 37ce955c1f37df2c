"""Random ragged batches over a paged KV cache, shared by the attention and kernel tests."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jserve.kernels import AttentionMetadata


def ragged_case(rng, decode_ctx, prefill, hq, hkv, d, page_size=4, width=16, pad_seqs=1):
    """decode_ctx: context lengths of decode rows (0: a padding row, one zero query and no
    KV); prefill: (already cached, chunk) pairs."""
    seqs = [(max(c - 1, 0), 1 if c else 0) for c in decode_ctx] + list(prefill)
    num_pages = 1 + sum(-(-(a + b) // page_size) for a, b in seqs)
    k_pages = np.zeros((hkv, num_pages, page_size, d), np.float32)
    v_pages = np.zeros_like(k_pages)
    free = list(rng.permutation(np.arange(1, num_pages)))  # scattered pages
    s = len(seqs) + pad_seqs
    table = np.zeros((s, width), np.int32)
    kv_lens = np.zeros(s, np.int32)
    q_parts, pos_parts, seq_parts, dense = [], [], [], []
    for i, (cached, chunk) in enumerate(seqs):
        total = cached + chunk
        pages = [free.pop() for _ in range(-(-total // page_size))]
        table[i, :len(pages)] = pages
        kv_lens[i] = total
        k = rng.normal(size=(total, hkv, d)).astype(np.float32)
        v = rng.normal(size=(total, hkv, d)).astype(np.float32)
        for p in range(total):
            k_pages[:, pages[p // page_size], p % page_size] = k[p]
            v_pages[:, pages[p // page_size], p % page_size] = v[p]
        q = rng.normal(size=(chunk, hq, d)).astype(np.float32)
        pos = np.arange(cached, total, dtype=np.int32)
        if not total:  # padding decode row
            q, pos = np.zeros((1, hq, d), np.float32), np.zeros(1, np.int32)
        q_parts.append(q)
        pos_parts.append(pos)
        seq_parts.append(np.full(len(q), i, np.int32))
        dense.append((q, k, v, pos))
    q = np.concatenate(q_parts)
    pad = 3  # padding tokens at the end own no sequence
    q = np.concatenate([q, np.zeros((pad, hq, d), np.float32)])
    positions = np.concatenate(pos_parts + [np.zeros(pad, np.int32)])
    token_seq = np.concatenate(seq_parts + [np.full(pad, s, np.int32)])
    meta = AttentionMetadata(positions=jnp.asarray(positions), token_seq=jnp.asarray(token_seq),
                             kv_lens=jnp.asarray(kv_lens), page_table=jnp.asarray(table),
                             num_prefills=jnp.asarray(len(prefill), jnp.int32),
                             num_decodes=len(decode_ctx))
    return q, k_pages, v_pages, meta, dense


# The Pallas flavours, interpreted on CPU. Small blocks keep the interpreted grids short while
# still crossing query blocks, sequences inside one block, and (GPU) several KV splits per
# decode.
def interpreted_flavours() -> dict:
    import functools

    from jserve.kernels import pallas_gpu, pallas_tpu
    return {"gpu": functools.partial(pallas_gpu.ragged_paged_attention, interpret=True,
                                     prefill_block_rows=32),
            "tpu": functools.partial(pallas_tpu.ragged_paged_attention, interpret=True,
                                     block_rows=32)}


def lowering_case(platform: str, target: str):
    """A mixed batch (a decode and a prefill chunk, head_dim 128) and ``jax.export`` for
    ``platform`` with the kernel's custom call (``target``) allowed: what the lowering tests
    export the accelerator kernels with, no device needed."""
    import functools

    import jax
    q, kp, vp, meta, _ = ragged_case(np.random.default_rng(0), [9, 0], [(0, 20), (30, 5)],
                                     hq=8, hkv=2, d=128, page_size=16, width=8)
    export = functools.partial(
        jax.export.export, platforms=[platform],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)])
    return q, kp, vp, meta, export

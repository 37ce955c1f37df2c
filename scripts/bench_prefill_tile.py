"""One layer's reference attention (``jserve.kernels.reference``) for a prefill chunk at long
context against the query-tile size: the prefix is read once per tile, so this shows whether
re-reading it (small tiles) or the chunk's compute decides the time on this machine. Default
model's heads (4 query, 2 KV, head_dim 64); interleaved repetitions, median.

    python scripts/bench_prefill_tile.py [--context 16384] [--chunks 256 512] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402

from jserve.kernels.reference import ragged_paged_attention  # noqa: E402
from ragged import ragged_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--context", type=int, default=16_384, help="KV tokens incl. the chunk")
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512], help="chunk sizes")
    ap.add_argument("--tiles", type=int, nargs="+", default=[64, 128, 256, 512],
                    help="query rows per tile (64 is the kernel's default)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.1f}; one layer, context {a.context}")
    for chunk in a.chunks:
        q, kp, vp, meta, _ = ragged_case(rng, [], [(a.context - chunk, chunk)], 4, 2, 64,
                                         page_size=16, width=a.context // 16 + 4)
        fns = {t: jax.jit(lambda q, kp, vp, meta, t=t: ragged_paged_attention(
            q, kp, vp, meta, rows_per_tile=t)) for t in a.tiles}
        for f in fns.values():
            jax.block_until_ready(f(q, kp, vp, meta))  # compile
        times: dict[int, list[float]] = {t: [] for t in fns}
        for _ in range(a.repeats):
            for t, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(q, kp, vp, meta))
                times[t].append(time.perf_counter() - t0)
        base = statistics.median(times[64]) if 64 in times else None
        print(f"chunk {chunk}: " + ", ".join(
            f"tile {t}: {statistics.median(v) * 1e3:.0f} ms"
            + (f" ({base / statistics.median(v):.2f}x tile 64)" if base else "")
            for t, v in times.items()))
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""What the HTTP front end costs next to gRPC: one ``jserve serve`` subprocess (both front
ends, one engine loop), and the same request workload through each, with the evaluation
harness's own clients (``jserve.bench.runner.run_remote`` for gRPC, ``run_http`` for the
OpenAI API: streaming, token-id prompts, greedy, ``ignore_eos``). TTFT and TPOT are taken on
the client as tokens arrive. The two front ends alternate for ``--repeats`` rounds after a
warm-up of each; the table shows the median of the rounds' percentiles. The machine may be
shared: alternating rounds is what keeps the comparison fair.

    python scripts/bench_server.py [--requests 200] [--batch 32] [--prompt-len 64] \\
        [--max-tokens 64] [--qps 0 (all at once)] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # conftest.Served: how the tests start a server

from conftest import Served  # noqa: E402

from jserve.bench.metrics import percentile, tpot, ttft  # noqa: E402
from jserve.bench.runner import run_http, run_remote  # noqa: E402
from jserve.sim.trace import TraceRequest  # noqa: E402


def figures(records: list[dict], wall: float) -> dict[str, float]:
    ttfts = [ttft(r) for r in records]
    tpots = [t for t in map(tpot, records) if t is not None]
    tokens = sum(r["output_tokens"] for r in records)
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "tpot_p50": percentile(tpots, 50), "tpot_p90": percentile(tpots, 90),
            "tok_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32, help="the server's --max-num-seqs")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--qps", type=float, default=0.0,
                    help="arrival rate (evenly spaced); 0: every request at once")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    gap = 1 / a.qps if a.qps > 0 else 0.0
    trace = [TraceRequest(str(i), i * gap, a.prompt_len, a.max_tokens)
             for i in range(a.requests)]
    served = Served("--max-num-seqs", str(a.batch), "--max-num-batched-tokens", "256",
                    "--max-model-len", "1024", "--log-level", "WARNING")
    runs = {"gRPC": lambda: run_remote(served.target, trace, progress=False),
            "HTTP": lambda: run_http(served.url, trace, progress=False)}
    results: dict[str, list[dict]] = {k: [] for k in runs}
    try:
        for rnd in range(a.repeats + 1):  # round 0 warms up (compiles) and is dropped
            for name, run in runs.items():
                t = time.perf_counter()
                records = asyncio.run(run())
                wall = time.perf_counter() - t
                assert all(r["finish_reason"] == "length" and r["output_tokens"] ==
                           a.max_tokens for r in records), name
                if rnd:
                    results[name].append(figures(records, wall))
    finally:
        served.proc.terminate()
        served.proc.wait(30)
        served.close()
    med = {name: {k: statistics.median(f[k] for f in fs) for k in fs[0]}
           for name, fs in results.items()}
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip() or platform.processor()
    print(f"{a.requests} requests x {a.prompt_len} prompt + {a.max_tokens} generated tokens, "
          f"greedy, {'all at once' if not gap else f'{a.qps:g} req/s'}, max_num_seqs="
          f"{a.batch}; median of {a.repeats} alternating rounds; {cpu}")
    print("| front end | TTFT P50 | TTFT P90 | TPOT P50 | TPOT P90 | throughput |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        print(f"| {name} | {m['ttft_p50'] * 1e3:.0f} ms | {m['ttft_p90'] * 1e3:.0f} ms | "
              f"{m['tpot_p50'] * 1e3:.1f} ms | {m['tpot_p90'] * 1e3:.1f} ms | "
              f"{m['tok_s']:.0f} tok/s |")
    g, h = med["gRPC"], med["HTTP"]
    print(f"HTTP overhead vs gRPC: TPOT P50 {100 * (h['tpot_p50'] / g['tpot_p50'] - 1):+.1f}%, "
          f"TPOT P90 {100 * (h['tpot_p90'] / g['tpot_p90'] - 1):+.1f}%, throughput "
          f"{100 * (h['tok_s'] / g['tok_s'] - 1):+.1f}%")


if __name__ == "__main__":
    main()

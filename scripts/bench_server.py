"""What the HTTP front end costs next to gRPC: one ``jserve serve`` subprocess (both front
ends, one engine loop), and the same request workload through each, with the evaluation
harness's own clients (``jserve.bench.replay.run_remote`` for gRPC, ``run_http`` for the
OpenAI API: streaming, token-id prompts, greedy, ``ignore_eos``). TTFT and TPOT are taken on
the client as tokens arrive; the engine's own TPOT (``jserve_time_per_output_token_seconds``,
observed on the engine thread) and the client's CPU seconds are shown beside them, since the
client shares the machine with the server. The two front ends alternate for ``--repeats``
rounds after a warm-up of each; the table shows the median of the rounds' percentiles. The
machine may be shared: alternating rounds is what keeps the comparison fair.

    python scripts/bench_server.py [--requests 200] [--batch 32] [--prompt-len 64] \\
        [--max-tokens 64] [--qps 0 (all at once)] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import time

from harness.served import Served, engine_tpot
from jserve.bench.metrics import percentile, tpot, ttft
from jserve.bench.replay import run_http, run_remote
from jserve.sim.trace import TraceRequest


def figures(records: list[dict], wall: float, engine: float, cpu: float) -> dict[str, float]:
    ttfts = [ttft(r) for r in records]
    tpots = [t for t in map(tpot, records) if t is not None]
    tokens = sum(r["output_tokens"] for r in records)
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "tpot_p50": percentile(tpots, 50), "tpot_p90": percentile(tpots, 90),
            "tok_s": tokens / wall, "engine_tpot": engine, "client_cpu": cpu}


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
                before, t, cpu = engine_tpot(served.url), time.perf_counter(), time.process_time()
                records = asyncio.run(run())
                wall, cpu = time.perf_counter() - t, time.process_time() - cpu
                after = engine_tpot(served.url)
                engine = (after[0] - before[0]) / max(1.0, after[1] - before[1])
                assert all(r["finish_reason"] == "length" and r["output_tokens"] ==
                           a.max_tokens for r in records), name
                if rnd:
                    results[name].append(figures(records, wall, engine, cpu))
    finally:
        served.stop(30)
    med = {name: {k: statistics.median(f[k] for f in fs) for k in fs[0]}
           for name, fs in results.items()}
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip() or platform.processor()
    print(f"{a.requests} requests x {a.prompt_len} prompt + {a.max_tokens} generated tokens, "
          f"greedy, {'all at once' if not gap else f'{a.qps:g} req/s'}, max_num_seqs="
          f"{a.batch}; median of {a.repeats} alternating rounds; {cpu}")
    print("| front end | TTFT P50 | TTFT P90 | TPOT P50 | TPOT P90 | throughput "
          "| engine TPOT (mean) | client CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        print(f"| {name} | {m['ttft_p50'] * 1e3:.0f} ms | {m['ttft_p90'] * 1e3:.0f} ms | "
              f"{m['tpot_p50'] * 1e3:.1f} ms | {m['tpot_p90'] * 1e3:.1f} ms | "
              f"{m['tok_s']:.0f} tok/s | {m['engine_tpot'] * 1e3:.1f} ms | "
              f"{m['client_cpu']:.2f} s |")
    g, h = med["gRPC"], med["HTTP"]

    def pct(k: str) -> str:
        return f"{100 * (h[k] / g[k] - 1):+.1f}%"
    print(f"HTTP vs gRPC: TPOT P50 {pct('tpot_p50')}, TPOT P90 {pct('tpot_p90')}, engine TPOT "
          f"{pct('engine_tpot')}, throughput {pct('tok_s')}; every round (HTTP/gRPC TPOT "
          f"P50): " + " ".join(f"{b['tpot_p50'] / a['tpot_p50']:.2f}"
                               for a, b in zip(results["gRPC"], results["HTTP"])))


if __name__ == "__main__":
    main()

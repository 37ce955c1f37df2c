"""Prefix caching at paper scale in the simulator: long documents asked about again and again.

    python scripts/sim_prefix_cache.py [--requests 400] [--asks 4] [--gap-s 60] [--load 0.8]

Llama-3 8B on 16 A100 (TP8 x SPP2, the time model of jserve.sim), ShareGPT4 short requests
with 5% Medha-SWE-like long documents (``harness.workload``); each document is asked
about ``--asks`` times (the first ask, then one every ``--gap-s`` seconds), each ask being the
document plus a 50-200-token question. lars with prefix caching off and on, at ``--load`` x
the time model's saturation QPS without caching. Prints short-request TTFT, long-request
completion time (arrival to last token) and the prefix hit rate.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.workload import WorkloadSpec, build_workload  # noqa: E402
from jserve.bench.metrics import LONG_PROMPT_TOKENS, percentile  # noqa: E402
from jserve.sim.policies import SimConfig, run, saturation  # noqa: E402
from jserve.sim.trace import TraceRequest  # noqa: E402

MESH = SimConfig(model="llama3-8b", hardware="a100", tp=8, spp=2)


def documents_asked_again(trace: list[TraceRequest], asks: int, gap_s: float, seed: int
                          ) -> list[TraceRequest]:
    """Every long request becomes a document asked ``asks`` times; shorts stay as they are."""
    rng = np.random.default_rng(seed)
    out = []
    for t in trace:
        if t.prompt_tokens < LONG_PROMPT_TOKENS:
            out.append(t)
            continue
        for k in range(asks):
            q = int(rng.integers(50, 201))
            out.append(dataclasses.replace(
                t, request_id=f"{t.request_id}-ask{k}", arrival_s=t.arrival_s + k * gap_s,
                prompt_tokens=t.prompt_tokens + q, prefix_id=t.request_id,
                prefix_tokens=t.prompt_tokens))
    return sorted(out, key=lambda r: r.arrival_s)


def _stats(trace: list[TraceRequest], records: list[dict]) -> dict:
    by_id = {r["request_id"]: r for r in records}
    short = [by_id[t.request_id] for t in trace if t.prefix_id is None]
    long = [by_id[t.request_id] for t in trace if t.prefix_id is not None]
    ttft = [r["first_token_s"] - r["arrival_s"] for r in short if r["first_token_s"] is not None]
    done = [r["finish_s"] - r["arrival_s"] for r in long if r["finish_s"] is not None]
    return {"short_ttft_p50": percentile(ttft, 50), "short_ttft_p90": percentile(ttft, 90),
            "long_completion_p50": percentile(done, 50),
            "long_completion_p90": percentile(done, 90),
            "long_completed": f"{len(done)}/{len(long)}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="before the repeated asks")
    ap.add_argument("--asks", type=int, default=4)
    ap.add_argument("--gap-s", type=float, default=60.0)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    def trace_at(qps: float) -> list[TraceRequest]:
        base = build_workload(WorkloadSpec(num_requests=a.requests, long_fraction=0.05,
                                           qps=qps, seed=a.seed))
        return documents_asked_again(base, a.asks, a.gap_s, a.seed)

    sat = saturation(trace_at(1.0), "lars", MESH)
    qps = round(a.load * sat * a.requests / len(trace_at(1.0)), 4)  # arrivals of first asks
    trace = trace_at(qps)
    docs = sum(t.prefix_id is not None for t in trace) // a.asks
    print(f"{len(trace)} requests ({docs} documents x {a.asks} asks, {a.gap_s:g} s apart); "
          f"saturation without caching {sat:.3f} QPS; running at {a.load:.0%}: "
          f"{qps * len(trace) / a.requests:.3f} QPS overall")
    rows = {}
    for caching in (False, True):
        recs = run(trace, "lars", dataclasses.replace(MESH, prefix_caching=caching))
        rows[caching] = _stats(trace, recs)
    print("\n| lars | caching off | caching on | off / on |\n|---|---:|---:|---:|")
    for k in ("short_ttft_p50", "short_ttft_p90", "long_completion_p50", "long_completion_p90"):
        off, on = rows[False][k], rows[True][k]
        print(f"| {k} | {off:.3f} s | {on:.3f} s | {off / on:.2f} |")
    print(f"| long completed | {rows[False]['long_completed']} | {rows[True]['long_completed']}"
          " | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

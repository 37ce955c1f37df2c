"""The prefix cache's host tier, off and on, in one run (docs/prefix_cache.md has the figures).

    python scripts/bench_kv_tier.py [--doc-tokens 1500] [--skip-live] [--skip-sim]

1. The issue's scenario, live (built-in ``default`` model, a device pool for about two
   documents): six documents asked in turn, then three times an earlier one asked again
   followed by a fresh one of the same length. Median TTFT of the repeats and the fresh ones.
2. A multi-turn long-document trace, live: ``--mt-docs`` documents (several times the pool)
   each asked ``--asks`` times with a short question, ``--shorts`` short chats after each
   ask, one request at a time. TTFT P50/P90 of repeats and shorts, the hit rate per tier,
   the pages and bytes the tier moved and the copy rate it learned.
3. The simulator at paper scale: lars on Llama-3 8B, 16 A100 (TP8 x SPP2), documents of
   100K-1M tokens asked 4 times 60 s apart between short requests, a device pool of 1.5M
   tokens and an 8M-token host tier at ``--pcie-gb-per-s`` per GPU.

Both live engines compile every step program before their runs (``warmup="all"``; the
second finds them in the persistent cache), so no timing includes a compile.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import kv_tier  # noqa: E402
from harness.kv_tier import SimTier  # noqa: E402


def _engine(tier: bool, doc_tokens: int):
    from jserve import LLM

    pages = -(-(doc_tokens + 64) // 16)  # a document with its question and answer
    return LLM("default", max_model_len=doc_tokens + 128, max_num_batched_tokens=512,
               max_num_seqs=4, num_kv_pages=2 * pages + 2, warmup="all",
               kv_offload_bytes=(256 << 20) if tier else 0)


def live(a) -> dict:
    out = {}
    for tier in (False, True):
        t0 = time.perf_counter()
        llm = _engine(tier, a.doc_tokens)
        kv_tier.ask_in_turn(llm, [[5] * 40])  # the first request's one-off costs
        scenario = kv_tier.documents(llm, a.doc_tokens, a.docs, a.repeats)
        trace = kv_tier.multi_turn_trace(a.mt_docs, a.doc_tokens, a.asks, a.shorts, seed=1)
        rows = kv_tier.ask_in_turn(llm, [p for _, p in trace], max_tokens=8)
        out["on" if tier else "off"] = dict(
            scenario={k: v for k, v in scenario.items() if k != "rows"},
            scenario_cached=[r["cached"] for r in scenario["rows"]],
            multi_turn=kv_tier.summarize_turns(trace, rows, llm.engine.kv_tier),
            seconds=time.perf_counter() - t0)
    return out


def _print_live(res: dict) -> None:
    off, on = res["off"], res["on"]
    print("\n| scenario (median of 3) | tier off | tier on |\n|---|---:|---:|")
    for k in ("repeat_ttft_s", "fresh_ttft_s"):
        print(f"| {k} | {off['scenario'][k] * 1e3:.0f} ms | {on['scenario'][k] * 1e3:.0f} ms |")
    for name, r in (("off", off), ("on", on)):
        s = r["scenario"]
        print(f"tier {name}: fresh / repeat = {s['fresh_ttft_s'] / s['repeat_ttft_s']:.1f}x; "
              f"cached tokens per request {r['scenario_cached']}")
    mo, mn = off["multi_turn"], on["multi_turn"]
    print("\n| multi-turn | tier off | tier on | off / on |\n|---|---:|---:|---:|")
    for kind in ("repeat", "short"):
        for q in ("p50_s", "p90_s"):
            a, b = mo[kind][q], mn[kind][q]
            print(f"| {kind} TTFT {q[:3].upper()} | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms "
                  f"| {a / b:.2f} |")
    for k in ("device_hit_rate", "host_hit_rate"):
        print(f"| {k} | {mo[k]:.1%} | {mn[k]:.1%} | |")
    print(f"| pages offloaded / restored | - | {mn['offloaded_pages']} / "
          f"{mn['restored_pages']} | |")
    print(f"| bytes moved | 0 | {mn['moved_bytes'] / 2**20:.1f} MiB | |")
    print(f"| restore copy time, learned rate | - | {mn['restore_seconds'] * 1e3:.1f} ms, "
          f"{mn['learned_gb_per_s']:.2f} GB/s | |")


def _print_sim(res: dict, s: SimTier) -> None:
    print(f"\n| simulator, lars, PCIe {s.pcie_gb_per_s:g} GB/s per GPU | tier off | tier on "
          "| off / on |\n|---|---:|---:|---:|")
    off, on = res["off"], res["on"]
    for k in ("repeat_ttft_p50_s", "repeat_ttft_p90_s", "short_ttft_p50_s",
              "short_ttft_p90_s"):
        print(f"| {k} | {off[k]:.3f} s | {on[k]:.3f} s | {off[k] / on[k]:.2f} |")
    for k in ("device_hit_rate", "host_hit_rate"):
        print(f"| {k} | {off[k]:.1%} | {on[k]:.1%} | |")
    print(f"| long requests completed | {off['long_done']}/{off['long']} | "
          f"{on['long_done']}/{on['long']} | |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--docs", type=int, default=6, help="scenario: documents asked in turn")
    ap.add_argument("--repeats", type=int, default=3, help="scenario: repeat + fresh pairs")
    ap.add_argument("--mt-docs", type=int, default=6, help="multi-turn: documents")
    ap.add_argument("--asks", type=int, default=3, help="multi-turn: asks per document")
    ap.add_argument("--shorts", type=int, default=2, help="multi-turn: chats after an ask")
    ap.add_argument("--pcie-gb-per-s", type=float, default=SimTier.pcie_gb_per_s)
    ap.add_argument("--skip-live", action="store_true")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--sim-modes", default="off,on",
                    help="simulator runs: tier off, on (one may run in another process)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    res = {}
    if not a.skip_live:
        res["live"] = live(a)
        _print_live(res["live"])
    if not a.skip_sim:
        s = SimTier(pcie_gb_per_s=a.pcie_gb_per_s)
        t0 = time.perf_counter()
        res["sim"] = kv_tier.simulated(s, modes=a.sim_modes.split(","))
        if len(res["sim"]) == 2:
            _print_sim(res["sim"], s)
        else:
            print(json.dumps(res["sim"], indent=1))
        print(f"(simulated in {time.perf_counter() - t0:.0f} s)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The convoy at real length, live (``scripts/convoy_real_length.py``, docs/convoy.md):
documents of 16K-32K tokens among short chats, over HTTP to a fresh ``jserve serve`` per
policy; the shorts' TTFT and TPOT, each document's TTFT and completion, and lars against
sarathi (the documents' TTFT ratio beside the shorts' gain)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import time

import numpy as np

from harness.served import Served
from harness.workload import WorkloadSpec, build_workload
from jserve.bench.metrics import summarize, tpot, ttft
from jserve.bench.replay import run_http
from jserve.sim.trace import TraceRequest, write_records

POLICIES = ("fcfs", "sarathi", "lars")


def build_trace(a: argparse.Namespace) -> list[TraceRequest]:
    """Short chats (ShareGPT4 lengths x1/4, Poisson at ``short_qps``) and ``documents`` long
    prompts, uniform in [doc_min, doc_max] tokens, ``doc_gap_s`` apart from t = 1 s."""
    shorts = build_workload(WorkloadSpec(num_requests=a.shorts, long_fraction=0.0,
                                         qps=a.short_qps, short_scale=1 / 4, output_scale=1 / 4,
                                         min_tokens=8, seed=a.seed))
    rng = np.random.default_rng(a.seed)
    docs = [TraceRequest(f"doc{i}", 1.0 + i * a.doc_gap_s,
                         int(rng.integers(a.doc_min, a.doc_max + 1)), a.doc_output)
            for i in range(a.documents)]
    shorts = [dataclasses.replace(t, request_id=f"short{i}", arrival_s=t.arrival_s + 2.0,
                                  output_tokens=min(t.output_tokens, a.short_output_max))
              for i, t in enumerate(shorts)]
    return sorted(docs + shorts, key=lambda t: t.arrival_s)


def run_policy(policy: str, trace: list[TraceRequest], a: argparse.Namespace) -> list[dict]:
    t0 = time.perf_counter()
    served = Served("--scheduler", policy, "--max-model-len", str(a.max_model_len),
                    "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                    "--max-num-seqs", "32", "--kv-cache-bytes", str(2 << 30),
                    "--log-level", "WARNING", warmup=True)
    print(f"== {policy}: server ready in {time.perf_counter() - t0:.0f}s ({served.url})",
          flush=True)
    try:
        records = asyncio.run(run_http(served.url, trace, seed=a.seed, progress=True))
    finally:
        served.stop(60)
    return [{**r, "policy": policy} for r in records]


def figures(records: list[dict], long_tokens: int) -> dict:
    s = summarize(records, long_prompt_tokens=long_tokens)
    docs = [r for r in records if r["prompt_tokens"] >= long_tokens]
    shorts = [r for r in records if r["prompt_tokens"] < long_tokens]
    tp = [t for t in map(tpot, shorts) if t is not None]
    return {**{k: s[k] for k in ("short_ttft_p50", "short_ttft_p90")},
            "short_tpot_p50": statistics.median(tp) if tp else float("nan"),
            "short_tpot_p90": float(np.percentile(tp, 90)) if tp else float("nan"),
            "docs": [{"id": r["request_id"], "prompt_tokens": r["prompt_tokens"],
                      "ttft_s": ttft(r),
                      "completion_s": (r["finish_s"] - r["arrival_s"]
                                       if r["finish_s"] is not None else float("inf"))}
                     for r in docs],
            "completed": sum(r["finish_s"] is not None for r in records), "n": len(records)}


def table(by: dict[str, dict]) -> list[str]:
    out = ["| policy | short TTFT P50 / P90 (s) | short TPOT P50 / P90 (ms) | documents: "
           "TTFT (s) | documents: completion (s) | completed |", "|---|---:|---:|---:|---:|---:|"]
    for p, f in by.items():
        out.append(f"| {p} | {f['short_ttft_p50']:.3f} / {f['short_ttft_p90']:.3f} | "
                   f"{f['short_tpot_p50'] * 1e3:.0f} / {f['short_tpot_p90'] * 1e3:.0f} | "
                   + ", ".join(f"{d['ttft_s']:.1f}" for d in f["docs"]) + " | "
                   + ", ".join(f"{d['completion_s']:.1f}" for d in f["docs"])
                   + f" | {f['completed']}/{f['n']} |")
    return out


def verdict(by: dict[str, dict]) -> list[str]:
    if not {"lars", "sarathi"} <= set(by):
        return []
    lars, sar = by["lars"], by["sarathi"]
    lines = []
    for dl, ds in zip(lars["docs"], sar["docs"]):
        x = dl["ttft_s"] / ds["ttft_s"]
        lines.append(f"{dl['id']} ({dl['prompt_tokens']} tokens): TTFT under lars "
                     f"{dl['ttft_s']:.1f} s, {x:.2f}x sarathi's {ds['ttft_s']:.1f} s "
                     f"({'within' if x <= 1.2 else 'OVER'} the 1.2x goal)")
    for q in (50, 90):
        k = f"short_ttft_p{q}"
        lines.append(f"short TTFT P{q}: lars {lars[k]:.3f} s, sarathi {sar[k]:.3f} s "
                     f"({sar[k] / lars[k]:.1f}x lower under lars)")
    return lines


def run(a: argparse.Namespace) -> None:
    """Every policy of ``a.policies`` on one trace, one fresh server each; the records, the
    table and the verdict under ``a.out_dir``. ``a``: the script's flags."""
    trace = build_trace(a)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()]
    by = {}
    t0 = time.perf_counter()
    for policy in a.policies:
        records = run_policy(policy, trace, a)
        load.append(os.getloadavg())
        write_records(a.out_dir / f"records-{policy}.jsonl", records)
        by[policy] = figures(records, a.doc_min)
        print("\n".join(table({policy: by[policy]})), flush=True)
    docs = [t for t in trace if t.prompt_tokens >= a.doc_min]
    head = (f"{len(trace)} requests: {len(docs)} documents ("
            + ", ".join(f"{t.prompt_tokens} tokens at {t.arrival_s:.0f} s" for t in docs)
            + f", {a.doc_output} output tokens), {a.shorts} short chats at {a.short_qps} QPS "
            f"(ShareGPT4 x1/4, outputs <= {a.short_output_max}); seed {a.seed}; server "
            f"--max-model-len {a.max_model_len} --max-num-batched-tokens "
            f"{a.max_num_batched_tokens}; {time.perf_counter() - t0:.0f} s in all; load "
            "average (1 min) before and after each policy: "
            + ", ".join(f"{x[0]:.1f}" for x in load))
    lines = [head, ""] + table(by) + [""] + [f"- {v}" for v in verdict(by)]
    (a.out_dir / "real_length.md").write_text("\n".join(lines) + "\n")
    (a.out_dir / "real_length.json").write_text(json.dumps(by, indent=1))
    print("\n".join(lines))

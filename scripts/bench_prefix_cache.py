"""Prefix caching on the live CPU engine: the same workloads with caching on and off, in one run.

    python scripts/bench_prefix_cache.py [--requests 64] [--doc-tokens 4096] [--qps 2]
                                         [--conversations 12] [--turns 4] [--reps 1]

1. Shared document: ``--requests`` questions of 1-200 tokens about one ``--doc-tokens``
   document (prompt = document + question), Poisson arrivals at ``--qps``, 16 output tokens
   each. TTFT P50/P90 and TPOT P50 with caching off and on, and their ratio.
2. Multi-turn: ``--conversations`` conversations of ``--turns`` turns whose user and answer
   lengths come from the ShareGPT4 trace (``--trace``; divided by ``--length-scale``); each
   turn re-sends the conversation so far (previous prompt + the engine's own answer + the
   new user turn) once the previous turn has finished. Prefix hit rate and TTFT with
   caching off and on.

Both engines use the built-in default model with the same settings, warmed up first (the
compile cache is shared, so neither pays for compiling in its timings). Prints a table and
writes JSON with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jserve import LLM, SamplingParams  # noqa: E402
from jserve.bench.metrics import percentile, summarize  # noqa: E402
from jserve.bench.replay import run_local  # noqa: E402
from jserve.sim.trace import TraceRequest, poisson_arrivals, read_lengths  # noqa: E402

OUTPUT_TOKENS = 16


def _engine(caching: bool, max_model_len: int, budget: int) -> LLM:
    return LLM("default", max_model_len=max_model_len, max_num_batched_tokens=budget,
               max_num_seqs=32, enable_prefix_caching=caching, warmup=True)


def shared_document(a, rng) -> dict:
    vocab = 320
    doc = rng.integers(3, vocab, a.doc_tokens).tolist()
    arrivals = poisson_arrivals(a.requests, a.qps, a.seed)
    trace, prompts = [], {}
    for i, at in enumerate(arrivals):
        q = rng.integers(3, vocab, int(rng.integers(1, 201))).tolist()
        rid = f"q{i}"
        prompts[rid] = doc + q
        trace.append(TraceRequest(rid, float(at), len(doc) + len(q), OUTPUT_TOKENS))
    out = {}
    for caching in (False, True):
        llm = _engine(caching, a.doc_tokens + 256, a.budget)
        runs = []
        for _ in range(a.reps):
            # Each repetition starts from an empty cache (a fresh engine would recompile).
            recs = run_local(llm.engine, trace, prompts=prompts, progress=False)
            runs.append(summarize(recs))
            llm.engine.allocator.check()
            assert llm.engine.allocator.num_allocated == 0
            _drop_cache(llm)
        out["on" if caching else "off"] = {
            k: statistics.median(r[k] for r in runs)
            for k in ("all_ttft_p50", "all_ttft_p90", "all_tpot_p50", "all_e2e_p50")} | {
            "prefix_hit_rate": statistics.median(r.get("prefix_hit_rate", 0.0) for r in runs)}
    return out


def _drop_cache(llm: LLM) -> None:
    """Evicts every idle cached page (allocating the whole pool once), so the next
    repetition starts cold."""
    alloc = llm.engine.allocator
    if alloc.prefix_caching and alloc.num_allocated == 0:
        alloc.free(alloc.allocate(alloc.total))


def multi_turn(a, rng) -> dict:
    pairs = read_lengths(a.trace)
    convs = []
    for _ in range(a.conversations):
        turns = [pairs[int(rng.integers(len(pairs)))] for _ in range(a.turns)]
        convs.append([(max(1, p // a.length_scale), max(1, min(o // a.length_scale, 64)))
                      for p, o in turns])
    max_len = max(sum(p + o for p, o in conv) for conv in convs) + 64
    out = {}
    for caching in (False, True):
        llm = _engine(caching, max_len, a.budget)
        eng = llm.engine
        start = time.monotonic()
        history = {c: [] for c in range(len(convs))}
        next_turn = {c: 0 for c in range(len(convs))}
        ready = {c: start + float(rng.exponential(0.5)) for c in range(len(convs))}
        ttfts, prompt_tokens, cached = [], 0, 0
        live: dict[str, int] = {}
        bar = tqdm(total=sum(map(len, convs)), desc=f"multi-turn caching={caching}",
                   unit="turn", leave=False)
        while ready or live:
            now = time.monotonic()
            for c, at in list(ready.items()):
                if at <= now:
                    user_len, out_len = convs[c][next_turn[c]]
                    history[c] += rng.integers(3, 320, user_len).tolist()
                    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
                    live[eng.add_request(list(history[c]), params, arrival_time=at)] = c
                    del ready[c]
            if not eng.has_unfinished():
                time.sleep(0.001)
                continue
            for o in eng.step():
                if not o.finished:
                    continue
                c = live.pop(o.request_id)
                ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
                prompt_tokens += len(o.prompt_token_ids)
                cached += o.metrics.cached_tokens
                history[c] += o.token_ids
                next_turn[c] += 1
                bar.update()
                if next_turn[c] < len(convs[c]):
                    ready[c] = time.monotonic() + float(rng.exponential(0.2))  # think time
        bar.close()
        eng.allocator.check()
        out["on" if caching else "off"] = {
            "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "prefix_hit_rate": cached / prompt_tokens, "turns": len(ttfts)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--qps", type=float, default=2.0)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--trace", default="sharegpt4",
                    help="multi-turn lengths: sharegpt4, azure-conv or a CSV/JSONL trace")
    ap.add_argument("--length-scale", type=int, default=4,
                    help="the trace's lengths are divided by this")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-multi-turn", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    rng = np.random.default_rng(a.seed)
    res = {"shared_document": shared_document(a, rng)}
    sd = res["shared_document"]
    print(f"\nshared document ({a.requests} requests, {a.doc_tokens}-token document, "
          f"{a.qps} QPS)\n| metric | caching off | caching on | off / on |\n|---|---:|---:|---:|")
    for k in ("all_ttft_p50", "all_ttft_p90", "all_tpot_p50", "all_e2e_p50"):
        print(f"| {k} | {sd['off'][k] * 1e3:.1f} ms | {sd['on'][k] * 1e3:.1f} ms | "
              f"{sd['off'][k] / sd['on'][k]:.2f} |")
    print(f"| prefix hit rate | {sd['off']['prefix_hit_rate']:.1%} | "
          f"{sd['on']['prefix_hit_rate']:.1%} | |")
    if not a.skip_multi_turn:
        res["multi_turn"] = mt = multi_turn(a, rng)
        print(f"\nmulti-turn ({a.conversations} conversations x {a.turns} turns, ShareGPT4 "
              f"lengths / {a.length_scale})\n| metric | caching off | caching on | off / on |"
              "\n|---|---:|---:|---:|")
        for k in ("ttft_p50", "ttft_p90"):
            print(f"| {k} | {mt['off'][k] * 1e3:.1f} ms | {mt['on'][k] * 1e3:.1f} ms | "
                  f"{mt['off'][k] / mt['on'][k]:.2f} |")
        print(f"| prefix hit rate | {mt['off']['prefix_hit_rate']:.1%} | "
              f"{mt['on']['prefix_hit_rate']:.1%} | |")
    print(f"load average at end: {os.getloadavg()}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

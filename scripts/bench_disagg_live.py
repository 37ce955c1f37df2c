"""Prefill/decode disaggregation live on this machine: colocated vs disaggregated vs chosen
per request, same run, same trace.

    python scripts/bench_disagg_live.py [--requests 48] [--qps 3] [--reps 3]

Three front ends (``jserve serve --data-parallel-size 2``), each with two engine processes
(the built-in model, small batches), stay up through the run:

- ``colocated``: two engines that prefill and decode (``--prefill-engines 0``; the deadline
  router places each request);
- ``disaggregated``: one prefill engine and one decode engine, every prompt prefilled on the
  first and its KV pages pulled by the second (``--disaggregation always``);
- ``auto``: the same two engines, the router choosing per request by deadline
  (``jserve.routing.disagg``).

The trace (``harness.routing_live.live_trace``, Poisson arrivals): per 8 requests three asks of
one ~1,200-token document and five short chats, each streaming ``--max-tokens`` tokens. Each
repetition runs the three in a rotated order on fresh documents; the figures are medians over
repetitions of: chat and document TTFT P50/P90, chat TPOT P50/P90 (the decode interference a
prefill causes), chat SLO attainment (TTFT within ``--short-slo``), and per run the placements
and the KV bytes pulled and their seconds (the engines' ``jserve_kv_transfer_*`` counters, so
the bandwidth the connector saw). Writes ``docs/scale_out/disagg_live.json``.

On a 2-core CPU the two engines of a front end share the cores: disaggregation cannot isolate
a decode from a prefill's compute here as separate accelerators would; what this measures is
the protocol's cost and the router's choices under that contention.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from harness.routing_live import live_trace  # noqa: E402
from harness.served import Served  # noqa: E402
from jserve.bench.metrics import percentile  # noqa: E402

ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "2048"]
MODES = {"colocated": ["--prefill-engines", "0"],
         "disaggregated": ["--prefill-engines", "1", "--disaggregation", "always"],
         "auto": ["--prefill-engines", "1", "--disaggregation", "auto"]}


def _totals(url: str) -> dict[str, float]:
    """The front end's summed counters (no ``engine`` label)."""
    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total") and "engine" not in s.labels and (
                    s.name.startswith(("jserve_kv_transfer", "jserve_front"))):
                key = s.name + "".join(f"[{v}]" for v in s.labels.values())
                out[key] = s.value
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
                  ) -> tuple[float, list[float]]:
    """(request start, each streamed chunk's arrival time), ``time.perf_counter``."""
    start, times = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/completions", json={
            "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                times.append(time.perf_counter())
        if r.status_code != 200 or not times:
            raise RuntimeError(f"{url}: status {r.status_code}")
    return start, times


async def _run(url: str, trace, max_tokens: int) -> list[tuple[bool, float, float | None]]:
    """(is a chat, TTFT, TPOT) of each request of ``trace``, sent open loop."""
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()

        async def one(r):
            await asyncio.sleep(max(r.at - (time.perf_counter() - t0), 0))
            start, times = await _stream(client, url, r.prompt, max_tokens)
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            return r.short, times[0] - start, tpot
        return await asyncio.gather(*(one(r) for r in trace))


def _row(res, slo: float, wall: float, before: dict, after: dict) -> dict:
    chats = [t for s, t, _ in res if s]
    docs = [t for s, t, _ in res if not s]
    tpot = [p for s, _, p in res if s and p is not None]
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    pulled = moved.get("jserve_kv_transfer_bytes_total[imported]", 0.0)
    seconds = moved.get("jserve_kv_transfer_seconds_total", 0.0)
    return {"chat_ttft_p50": percentile(chats, 50), "chat_ttft_p90": percentile(chats, 90),
            "doc_ttft_p50": percentile(docs, 50), "doc_ttft_p90": percentile(docs, 90),
            "chat_tpot_p50": percentile(tpot, 50), "chat_tpot_p90": percentile(tpot, 90),
            "chat_attainment": sum(t <= slo for t in chats) / len(chats), "wall_s": wall,
            "disaggregated": moved.get("jserve_front_placements_total[disaggregated]", 0.0),
            "kv_bytes_pulled": pulled,
            "kv_pull_bytes_per_s": pulled / seconds if seconds else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--qps", type=float, default=3.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--short-slo", type=float, default=0.5, help="chat TTFT SLO (s)")
    p.add_argument("--out", default=str(ROOT / "docs" / "scale_out" / "disagg_live.json"))
    a = p.parse_args()
    fronts = {m: Served("--data-parallel-size", "2", *flags, *ENGINE)
              for m, flags in MODES.items()}
    try:
        for s in fronts.values():  # compile every shape the trace uses
            asyncio.run(_run(s.url, live_trace(16, 50.0, 12345), a.max_tokens))
        rows: dict[str, list] = {m: [] for m in MODES}
        names = list(MODES)
        for rep in range(a.reps):
            for i in range(len(names)):
                m = names[(i + rep) % len(names)]
                trace = live_trace(a.requests, a.qps, seed=1000 * rep + i)
                before = _totals(fronts[m].url)
                t0 = time.perf_counter()
                res = asyncio.run(_run(fronts[m].url, trace, a.max_tokens))
                wall = time.perf_counter() - t0
                rows[m].append(_row(res, a.short_slo, wall, before, _totals(fronts[m].url)))
                print(m, json.dumps(rows[m][-1]), flush=True)
    finally:
        for s in fronts.values():
            s.stop(60)
    table = {m: {k: statistics.median(r[k] for r in v if r[k] is not None)
                 if any(r[k] is not None for r in v) else None for k in v[0]}
             for m, v in rows.items()}
    out = {"command": " ".join(["python", "scripts/bench_disagg_live.py", *sys.argv[1:]]),
           "machine": f"{os.cpu_count()} CPUs", "uptime_before": os.popen("uptime").read().strip(),
           "requests": a.requests, "qps": a.qps, "reps": a.reps, "max_tokens": a.max_tokens,
           "short_slo": a.short_slo, "table": table, "runs": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for m, r in table.items():
        print(f"{m:14s} " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in r.items()))


if __name__ == "__main__":
    main()

"""guidellm (vLLM's benchmark tool) next to jserve's own harness, for the same load
(``scripts/bench_guidellm.py``): on one running ``jserve serve``, for each profile
(synchronous, then concurrent) guidellm and the harness (``run_http``) with the same lengths,
counts and concurrency, each with the engine's own figures from the server's metrics and the
SSE stream's tokens per chunk; the markdown report of it all."""
from __future__ import annotations

import asyncio
import json
import platform
import resource
import subprocess
import time
from typing import Callable

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from harness import guidellm
from jserve.bench.metrics import summarize
from jserve.bench.replay import run_http
from jserve.sim.trace import TraceRequest, write_records

COLUMNS = ("ok", "errored", "ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "e2e_p50", "tok_s",
           "req_s")


def engine(url: str) -> dict[str, float]:
    """The server's counters this script reads (sums and counts of its histograms)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    want = ("jserve_time_to_first_token_seconds_", "jserve_time_per_output_token_seconds_",
            "jserve_generation_tokens_total")
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith(want)}


def children_cpu() -> float:
    """CPU seconds of this process's finished children (guidellm and its workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def engine_figures(before: dict, after: dict) -> dict[str, float]:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    ttft, tpot = "jserve_time_to_first_token_seconds_", "jserve_time_per_output_token_seconds_"
    steps = d[ttft + "count"] + d[tpot + "count"]  # a request's steps that gave it tokens
    return {"ttft_mean": d[ttft + "sum"] / max(1.0, d[ttft + "count"]),
            "tpot_mean": d[tpot + "sum"] / max(1.0, d[tpot + "count"]),
            "tokens_per_step": d["jserve_generation_tokens_total"] / max(1.0, steps)}


def record_figures(records: list[dict]) -> dict[str, float]:
    """The harness's formulas (``jserve.bench.metrics``): TTFT, ITL = TPOT per request
    (``(last - first token) / (tokens - 1)``), end to end; throughput over the run's window."""
    s = summarize(records)
    done = [r for r in records if r["finish_s"] is not None]
    return {"ok": len(done), "errored": len(records) - len(done),
            "ttft_p50": s["all_ttft_p50"], "ttft_p90": s["all_ttft_p90"],
            "itl_p50": s["all_tpot_p50"], "itl_p90": s["all_tpot_p90"],
            "e2e_p50": s["all_e2e_p50"],
            "tok_s": sum(r["output_tokens"] for r in done) / s["window_s"],
            "req_s": len(done) / s["window_s"]}


async def chunk_sizes(url: str, model: str, prompt: int, tokens: int, n: int, streams: int
                      ) -> list[int]:
    """Tokens per SSE chunk of ``n`` streams, ``streams`` at a time (their usage on every
    chunk: ``continuous_usage_stats``)."""
    sizes: list[int] = []
    gate = asyncio.Semaphore(streams)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async def one(i: int) -> None:
            body = {"model": model, "prompt": [100 + (i + k) % 200 for k in range(prompt)],
                    "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True,
                                                       "continuous_usage_stats": True}}
            done = 0
            async with gate, client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"choices": []' not in line:
                        now = json.loads(line[6:])["usage"]["completion_tokens"]
                        sizes.append(now - done)
                        done = now
        await asyncio.gather(*(one(i) for i in range(n)))
    return sizes


def fmt(row: dict) -> str:
    ms = lambda k: f"{row[k] * 1e3:.1f} ms"
    return (f"{row['ok']} | {row['errored']} | {ms('ttft_p50')} | {ms('ttft_p90')} | "
            f"{ms('itl_p50')} | {ms('itl_p90')} | {row['e2e_p50']:.3f} s | "
            f"{row['tok_s']:.1f} | {row['req_s']:.2f}")


def compare(url: str, model_dir: str, model: str, a, step: Callable[[str], None]) -> list:
    """Both profiles, guidellm then the harness then the chunk sizes, on the server at
    ``url``; one table entry per profile (``render_report`` writes them). ``a``: the script's flags
    (lengths, counts, streams, ``out`` for guidellm's JSON and the harness's records)."""
    profiles = [("synchronous", "synchronous", a.sync_requests, 1),
                (f"concurrent, {a.streams} streams", f"concurrent,streams={a.streams}",
                 a.requests, a.streams)]
    tables = []
    for label, profile, n, c in profiles:
        tables.append(_profile(url, model_dir, model, a, step, label, profile, n, c))
    return tables


def _profile(url: str, model_dir: str, model: str, a, step: Callable[[str], None], label: str,
             profile: str, n: int, c: int) -> tuple:
    """One profile: guidellm, the harness, the chunk sizes; its table entry."""
    name = profile.split(",")[0]
    step(f"{label}: guidellm, {n} requests (its own progress below)")
    before, cpu = engine(url), children_cpu()
    bench = guidellm.run(url, model_dir, profile, n, a.prompt_tokens,
                         a.output_tokens, a.out / f"guidellm-{name}.json",
                         workers=a.guidellm_workers, quiet=False)
    g_engine = engine_figures(before, engine(url))
    g_engine["client_cpu"] = children_cpu() - cpu
    step(f"{label}: jserve's harness (run_http), {n} requests")
    trace = [TraceRequest(str(i), 0.0, a.prompt_tokens, a.output_tokens)
             for i in range(n)]
    before, cpu = engine(url), time.process_time()
    records = asyncio.run(run_http(url, trace, concurrency=c))
    h_engine = engine_figures(before, engine(url))
    h_engine["client_cpu"] = time.process_time() - cpu
    write_records(a.out / f"harness-{name}.jsonl", records)
    step(f"{label}: tokens per SSE chunk")
    sizes = asyncio.run(chunk_sizes(url, model, a.prompt_tokens,
                                    a.output_tokens, n, c))
    return (label, [
        ("guidellm (its report)", guidellm.summary(bench)),
        ("guidellm's requests, harness formulas",
         record_figures(guidellm.records(bench))),
        ("jserve harness (run_http)", record_figures(records))],
        g_engine, h_engine, sum(sizes) / len(sizes), bench)


def render_report(command: str, model: str, model_dir: str, a, tables: list) -> str:
    """The markdown report: per profile the three sources' figures and the engine's own."""
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip() or platform.processor()
    lines = [f"`{command}`: "
             f"{model} ({model_dir}), {a.prompt_tokens} prompt + {a.output_tokens} generated "
             f"tokens a request, {cpu}", ""]
    for label, rows, g_engine, h_engine, per_chunk, bench in tables:
        lines += [f"**{label}**", "",
                  "| source | ok | errored | TTFT P50 | TTFT P90 | ITL P50 | ITL P90 "
                  "| latency P50 | output tok/s | req/s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {src} | {fmt(row)} |" for src, row in rows]
        per_iter = bench["metrics"]["output_tokens_per_iteration"]["successful"]["mean"]
        lines += ["", f"Engine during guidellm: TTFT mean {g_engine['ttft_mean'] * 1e3:.1f} "
                      f"ms, TPOT mean {g_engine['tpot_mean'] * 1e3:.1f} ms (guidellm's CPU, "
                      f"its start-up included, {g_engine['client_cpu']:.1f} s); during the "
                      f"harness: TTFT mean "
                      f"{h_engine['ttft_mean'] * 1e3:.1f} ms, TPOT mean "
                      f"{h_engine['tpot_mean'] * 1e3:.1f} ms (the harness's CPU "
                      f"{h_engine['client_cpu']:.1f} s). Tokens per engine step per "
                      f"request {g_engine['tokens_per_step']:.2f}; per SSE chunk "
                      f"{per_chunk:.2f} (every chunk); guidellm's output tokens per "
                      f"iteration {per_iter:.2f} (chunks with text only).", ""]
    return "\n".join(lines)

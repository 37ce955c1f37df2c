"""``jserve bench serve`` and aiperf against the same ``jserve serve``, one after the other, with
the same workload shape: N streaming completions of random prompts of ISL tokens, each
generating exactly OSL tokens (EOS ignored), C at a time (``scripts/bench_serve_vs_aiperf.py``).

Per run: the tool's own figures; for aiperf also jserve's formulas
(``jserve.bench.metrics.serving_result``) on aiperf's own timestamps, which separates what the
two tools measure from how each computes it; the engine's own TTFT and TPOT means from the
server's /metrics over the run (observed on the engine thread, so the client's view of them
can be told apart from the server's); and the client's CPU seconds (it shares the machine
with the server). Definitions differ by name: vLLM's ITL is every gap between chunks and its
TPOT is per request; aiperf's "inter token latency" is vLLM's TPOT and its "inter chunk
latency" vLLM's ITL. The table puts like with like.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from harness import aiperf
from harness.guidellm_compare import children_cpu, engine, engine_figures
from jserve.bench.metrics import serving_result
from jserve.bench.serve_bench import bench_serve

COLUMNS = ("ok", "errored", "req_s", "tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
           "tpot_p50", "tpot_p99")


def _from_vllm_keys(res: dict) -> dict:
    ms = {f"{m}_{q}": res[f"{'median' if q == 'p50' else q}_{m}_ms"] / 1e3
          for m in ("ttft", "itl", "tpot") for q in ("p50", "p99")}
    return {"ok": res["completed"], "errored": res["failed"],
            "req_s": res["request_throughput"], "tok_s": res["output_throughput"], **ms}


def _gaps(per_request: list[list[float]]) -> float:
    """Gaps between chunks a request, on average: OSL - 1 when every token's chunk counts."""
    return sum(map(len, per_request)) / max(1, len(per_request))


def bench_serve_argv(url: str, model: str, a, n: int, result: Path | None) -> list[str]:
    """``jserve bench serve``'s flags for ``n`` requests of the workload; the result JSON
    written to ``result`` when given."""
    argv = ["--base-url", url, "--model", model, "--num-prompts", str(n),
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--max-concurrency", str(a.concurrency), "--percentile-metrics",
            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm"]
    return argv + (["--save-result", "--result-dir", str(result.parent),
                    "--result-filename", result.name] if result else [])


def compare(url: str, model: str, tokenizer_dir: str | Path, a, out: Path,
            step: Callable[[str], None]) -> dict:
    """Warms the server with a small run, then for each of ``a.rounds`` rounds ``jserve bench
    serve`` and aiperf; the rows (``rows``: a label and ``COLUMNS`` plus the engine's figures
    and the client's CPU) and the exact commands (``commands``)."""
    step("warm-up: jserve bench serve, 2 x concurrency requests")
    bench_serve(bench_serve_argv(url, model, a, 2 * a.concurrency, None))
    rows, commands = [], {}
    for rnd in range(1, a.rounds + 1):
        step(f"round {rnd}: jserve bench serve, {a.num_prompts} requests")
        argv = bench_serve_argv(url, model, a, a.num_prompts, out / f"bench-serve-r{rnd}.json")
        argv.append("--save-detailed")
        commands["jserve bench serve"] = "jserve bench serve " + " ".join(argv)
        before, cpu = engine(url), time.process_time()
        res = bench_serve(argv)
        rows.append({"label": f"jserve bench serve (round {rnd})", **_from_vllm_keys(res),
                     **engine_figures(before, engine(url)), "gaps": _gaps(res["itls"]),
                     "client_cpu": time.process_time() - cpu})
        step(f"round {rnd}: aiperf profile, {a.num_prompts} requests")
        cmd = aiperf.command(url, model, tokenizer_dir, out / f"aiperf-r{rnd}",
                             endpoint_type="completions", requests=a.num_prompts,
                             concurrency=a.concurrency, isl=a.input_len, osl=a.output_len)
        commands["aiperf"] = " ".join(cmd)
        before, cpu = engine(url), children_cpu()
        export = aiperf.run(cmd, timeout=3600)
        recs = aiperf.records(out / f"aiperf-r{rnd}")
        eng = {**engine_figures(before, engine(url)), "client_cpu": children_cpu() - cpu,
               "gaps": _gaps([r["chunk_times_s"][1:] for r in recs])}
        rows.append({"label": f"aiperf, its report (round {rnd})", **aiperf.summary(export),
                     **eng})
        mine = serving_result(recs, export["benchmark_duration"]["avg"],
                              metrics=("ttft", "tpot", "itl"), percentiles=(99,))
        rows.append({"label": f"aiperf's timestamps, jserve's formulas (round {rnd})",
                     **_from_vllm_keys(mine), **eng})
    return {"rows": rows, "commands": commands}


def render(title: str, table: dict) -> str:
    """One markdown table of ``compare``'s rows and the commands behind it."""
    ms = lambda x: f"{x * 1e3:.1f} ms"
    lines = [f"**{title}**", "",
             "| source | ok | errored | req/s | output tok/s | TTFT P50 | TTFT P99 | ITL P50 "
             "| ITL P99 | TPOT P50 | TPOT P99 | engine TTFT mean | engine TPOT mean "
             "| chunk gaps a request | client CPU |", "|---" + "|---:" * 14 + "|"]
    for r in table["rows"]:
        lines.append(f"| {r['label']} | {r['ok']} | {r['errored']} | {r['req_s']:.2f} | "
                     f"{r['tok_s']:.1f} | " + " | ".join(ms(r[k]) for k in COLUMNS[4:])
                     + f" | {ms(r['ttft_mean'])} | {ms(r['tpot_mean'])} | {r['gaps']:.1f} | "
                       f"{r['client_cpu']:.1f} s |")
    lines += ["", "```bash", *table["commands"].values(), "```"]
    return "\n".join(lines)

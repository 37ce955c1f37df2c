"""guidellm (vLLM's benchmark tool, in the ``test`` extra) against an OpenAI-compatible server:
one profile on synthetic data (``run``), what its JSON report says (``summary``), and its
requests as the harness's records (``records``), so the harness's own formulas
(``jserve.bench.metrics``) can be applied to guidellm's timestamps too.

guidellm makes prompts of an exact token count with a Hugging Face tokenizer (a local
directory here: nothing is fetched) and asks for exactly ``output_tokens`` (``ignore_eos``),
streaming with vLLM's ``stream_options.continuous_usage_stats``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run(url: str, tokenizer_dir: str | Path, profile: str, requests: int, prompt_tokens: int,
        output_tokens: int, report: Path, *, workers: int | None = None, quiet: bool = True,
        endpoint: str = "/v1/completions", timeout: float = 1800) -> dict:
    """``guidellm run`` of one ``profile`` (``synchronous``, ``concurrent,streams=8``, ...)
    for ``requests`` requests; returns the benchmark of its JSON report (written to
    ``report``). ``workers``: guidellm's worker processes at most (it starts up to 10);
    ``quiet``: keep its console output (shown if it fails), else let it print progress."""
    report = Path(report).resolve()
    report.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if workers is not None:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(workers)
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},request_format={endpoint}",
           "--profile", f"kind={profile}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                     f"output_tokens={output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    done = subprocess.run(cmd, env=env, cwd=report.parent, capture_output=quiet, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        tail = (done.stdout or "")[-3000:] + (done.stderr or "")[-3000:] if quiet else ""
        raise RuntimeError(f"guidellm exited {done.returncode}: {' '.join(cmd)}\n{tail}")
    return json.loads(report.read_text())["benchmarks"][0]


def requests_made(bench: dict) -> dict[str, int]:
    """The requests guidellm made, by outcome, from the scheduler's final state. (Its
    ``scheduler_metrics.requests_made`` is the state that came with whichever request's
    update its accumulator processed last, which under load can be an earlier one's: 5 of 6
    seen on a loaded machine.)"""
    st = bench["scheduler_state"]
    made = {"successful": st["successful_requests"], "errored": st["errored_requests"],
            "incomplete": st["cancelled_requests"]}
    return {**made, "total": sum(made.values())}


def summary(bench: dict) -> dict[str, float]:
    """guidellm's own figures (latencies in seconds): TTFT and ITL (``(last - first token) /
    (tokens - 1)``, weighted per token) at the harness's quantiles (P50, P90), request latency
    median, output tokens and requests per second (the means of its console table)."""
    m = bench["metrics"]

    def stat(name: str, key: str, scale: float = 1.0) -> float:
        s = m[name]["successful"]
        return (s[key] if key in s else s["percentiles"][key]) * scale
    made = requests_made(bench)
    return {"ok": made["successful"], "errored": made["errored"],
            "incomplete": made["incomplete"],
            "ttft_p50": stat("time_to_first_token_ms", "median", 1e-3),
            "ttft_p90": stat("time_to_first_token_ms", "p90", 1e-3),
            "itl_p50": stat("inter_token_latency_ms", "median", 1e-3),
            "itl_p90": stat("inter_token_latency_ms", "p90", 1e-3),
            "e2e_p50": stat("request_latency", "median"),
            "tok_s": stat("output_tokens_per_second", "mean"),
            "req_s": stat("requests_per_second", "mean")}


def records(bench: dict) -> list[dict]:
    """guidellm's successful requests as harness records (seconds from the first request's
    start): arrival when it was sent, first and last token when their chunks arrived."""
    reqs = bench["requests"]["successful"]
    if not reqs:
        return []
    t0 = min(r["request_start_time"] for r in reqs)
    out = []
    for r in reqs:
        t = r["info"]["timings"]
        out.append({"request_id": r["request_id"], "prompt_tokens":
                    r["input_metrics"]["text_tokens"],
                    "output_tokens": r["output_metrics"]["text_tokens"],
                    "arrival_s": r["request_start_time"] - t0,
                    "first_token_s": t["first_token_iteration"] - t0,
                    "finish_s": t["last_token_iteration"] - t0,
                    "finish_reason": "length"})
    return out

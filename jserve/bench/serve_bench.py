"""``jserve bench serve``: vLLM's ``vllm bench serve`` against any running OpenAI-compatible
server (jserve or another), with vLLM's option names, printed summary and result JSON keys,
run by jserve's replay harness (requests: ``jserve.bench.datasets``; the HTTP client:
``jserve.bench.replay.run_http``; figures: ``jserve.bench.metrics.serving_result``).

Every request streams (``stream_options.include_usage``), so output tokens are the server's
count. With ``--max-concurrency`` a request's latency counts from when it is sent, not from
when it would have arrived, as in vLLM. This module imports no JAX.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from datetime import datetime
from pathlib import Path

CHAT_ENDPOINT = "/v1/chat/completions"
BACKENDS = ("vllm", "openai", "openai-chat")  # vLLM's names of the request format


def add_bench_parser(sub) -> None:
    """``jserve bench`` and its one subcommand, ``serve``."""
    b = sub.add_parser("bench", help="benchmarks against a running server (vLLM's `bench`)")
    bsub = b.add_subparsers(dest="bench_command", required=True, help="serve: a running "
                                                                      "server's serving figures")
    s = bsub.add_parser("serve", help="drive a running OpenAI-compatible server, as `vllm "
                                      "bench serve` does, and report its serving figures",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_target_args(s)
    _add_dataset_args(s)
    _add_load_args(s)
    _add_result_args(s)
    s.set_defaults(func=serve_command)


def _add_target_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="the server's base URL (e.g. http://host:8000); None: --host/--port")
    g.add_argument("--host", default="127.0.0.1", help="the server's host (without --base-url)")
    g.add_argument("--port", type=int, default=8000, help="the server's HTTP port")
    g.add_argument("--endpoint", default=None,
                   help="/v1/completions or /v1/chat/completions; None: --backend's")
    g.add_argument("--backend", choices=BACKENDS, default="openai",
                   help="the request format (openai-chat: the chat endpoint)")
    g.add_argument("--model", default=None, help="None: the first of the server's /v1/models")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory, for text prompts; None: --model's directory "
                        "if it is one, else the server's own /tokenize and /detokenize")
    g.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY'; None: $OPENAI_API_KEY if set")


def _add_dataset_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("requests")
    g.add_argument("--dataset-name", choices=("random", "sharegpt", "custom"), default="random",
                   help="where the prompts come from")
    g.add_argument("--dataset-path", default=None,
                   help="sharegpt: a local ShareGPT JSON file; custom: JSONL, a 'prompt' (and "
                        "optionally 'output_tokens') per line")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt tokens (the middle of the range)")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="random: tokens to generate (the middle of the range)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len x (1 - r), len x (1 + r)]; r in [0, 1)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="every output this long; None: the conversation's second turn's")
    g.add_argument("--custom-output-len", type=int, default=256,
                   help="output length of a custom line without 'output_tokens'")
    g.add_argument("--seed", type=int, default=0,
                   help="draws the prompts, lengths, sampled lines and arrivals")


def _add_load_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson arrivals at burstiness 1); inf: all at "
                        "once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps between arrivals (< 1 burstier, > 1 steadier)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (the others wait on the client)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate every request's full output length (always on for random)")
    g.add_argument("--temperature", type=float, default=None,
                   help="sent with every request; None: the server's default")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_result_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="of ttft, tpot, itl, e2el")
    g.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--save-detailed", action="store_true",
                   help="the result with each request's lengths, TTFT, ITLs, latency, error")
    g.add_argument("--result-dir", default=None, help="None: the current directory")
    g.add_argument("--result-filename", default=None,
                   help="None: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    g.add_argument("--label", default=None, help="the result's label (None: --backend)")


def _endpoint(a: argparse.Namespace) -> str:
    if a.endpoint is not None:
        return a.endpoint
    return CHAT_ENDPOINT if a.backend == "openai-chat" else "/v1/completions"


def _model_info(base: str, headers: dict[str, str]) -> dict:
    import httpx2 as httpx

    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"no server at {base}: {e}") from None
    if r.status_code != 200 or not r.json().get("data"):
        raise ValueError(f"{base}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]


def _tokenizer(a: argparse.Namespace, base: str, model: str, headers: dict, info: dict):
    """(tokenizer, its name for the result): --tokenizer, --model's directory, or the
    server's."""
    from jserve.bench import datasets

    for path in (a.tokenizer, a.model):
        if path is not None and Path(path).is_dir():
            return datasets.LocalTokenizer(path), str(path)
    if a.tokenizer is not None:
        raise ValueError(f"--tokenizer {a.tokenizer}: not a directory")
    return datasets.ServerTokenizer(base, model, headers, info.get("vocab_size")), "server"


def _samples(a: argparse.Namespace, chat: bool, tok, vocab_size: int, rng) -> list:
    from jserve.bench import datasets

    if a.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if a.dataset_name == "random":
        if a.dataset_path is not None:
            raise ValueError("--dataset-path is for sharegpt and custom, not random")
        return datasets.random_samples(a.num_prompts, a.random_input_len,
                                       a.random_output_len, a.random_range_ratio,
                                       getattr(tok, "vocab_size", None) or vocab_size, rng,
                                       tok if chat else None)
    if a.dataset_path is None:
        raise ValueError(f"--dataset-name {a.dataset_name} needs --dataset-path")
    if a.dataset_name == "sharegpt":
        return datasets.sharegpt_samples(a.dataset_path, a.num_prompts, tok, rng,
                                         a.sharegpt_output_len)
    return datasets.custom_samples(a.dataset_path, a.num_prompts, tok, rng,
                                   a.custom_output_len)


def serve_command(a: argparse.Namespace) -> int:
    run_bench(a)
    return 0


def bench_serve(argv: list[str]) -> dict:
    """``jserve bench serve ARGV`` from Python; its result (as the JSON it saves)."""
    p = argparse.ArgumentParser(prog="jserve bench serve")
    for add in (_add_target_args, _add_dataset_args, _add_load_args, _add_result_args):
        add(p)
    return run_bench(p.parse_args(argv))


def run_bench(a: argparse.Namespace) -> dict:
    """Draws the requests, runs them, prints the summary, writes the JSON if asked; the
    result."""
    import asyncio

    from jserve.bench.metrics import serving_result
    from jserve.bench.replay import run_http

    metrics, percentiles = _metric_args(a)
    base = (a.base_url or f"http://{a.host}:{a.port}").rstrip("/")
    a.api_key = a.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    info = _model_info(base, headers)
    model, endpoint = a.model or info["id"], _endpoint(a)
    chat = endpoint.rstrip("/").endswith("/chat/completions")
    needs_text = chat or a.dataset_name != "random"  # random completions: token-id prompts
    tok, tok_name = _tokenizer(a, base, model, headers, info) \
        if needs_text or a.tokenizer else (None, None)
    trace, prompts = _requests(a, chat, tok, info)
    fields = {"ignore_eos": a.ignore_eos or a.dataset_name == "random",
              **({} if a.temperature is None else {"temperature": a.temperature})}
    print(f"Traffic request rate: {a.request_rate}\nBurstiness factor: {a.burstiness} "
          f"({'Poisson process' if a.burstiness == 1 else 'Gamma distribution'})\n"
          f"Maximum request concurrency: {a.max_concurrency}", flush=True)
    records = asyncio.run(run_http(base, trace, prompts=prompts, endpoint=endpoint,
                                   fields=fields, model=model, auth_token=a.api_key,
                                   concurrency=a.max_concurrency,
                                   progress=not a.disable_tqdm))
    res = serving_result(records, max(r["done_s"] for r in records), metrics=metrics,
                         percentiles=percentiles)
    print(format_result(res, metrics, percentiles, a.max_concurrency, a.request_rate))
    backend = "openai-chat" if chat else a.backend
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend,
           "backend": backend, "label": a.label, "model_id": model, "tokenizer_id": tok_name,
           "num_prompts": a.num_prompts,
           "request_rate": "inf" if math.isinf(a.request_rate) else a.request_rate,
           "burstiness": a.burstiness, "max_concurrency": a.max_concurrency, **res}
    if a.save_detailed:
        out.update(detailed(records))
    if a.save_result:
        path = result_path(a, out)
        path.write_text(json.dumps(out))
        print(f"wrote {path}")
    return out


def _metric_args(a: argparse.Namespace) -> tuple[list[str], list[float]]:
    from jserve.bench.metrics import SERVING_METRICS

    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    metrics = [m.strip() for m in a.percentile_metrics.split(",") if m.strip()]
    if unknown := sorted(set(metrics) - set(SERVING_METRICS)):
        raise ValueError(f"--percentile-metrics: {', '.join(unknown)} not among "
                         f"{', '.join(SERVING_METRICS)}")
    try:
        percentiles = [float(p) for p in a.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles: numbers, got {a.metric_percentiles!r}") \
            from None
    if not all(0 <= q <= 100 for q in percentiles):
        raise ValueError("--metric-percentiles: each in [0, 100]")
    return metrics, percentiles


def _requests(a: argparse.Namespace, chat: bool, tok, info: dict) -> tuple[list, dict]:
    """The trace requests (lengths, arrivals) and their prompts."""
    import numpy as np

    from jserve.bench import datasets
    from jserve.bench.replay import HTTP_FALLBACK_VOCAB

    rng = np.random.default_rng(a.seed)
    samples = _samples(a, chat, tok, info.get("vocab_size", HTTP_FALLBACK_VOCAB), rng)
    return datasets.as_trace(
        samples, datasets.arrival_times(len(samples), a.request_rate, a.burstiness, rng))


def detailed(records: list[dict]) -> dict:
    """Per-request lists (vLLM's ``--save-detailed`` keys), in request order."""
    ok = [r["finish_s"] is not None for r in records]
    return {"input_lens": [r.get("usage_prompt_tokens") or r["prompt_tokens"] for r in records],
            "output_lens": [r["output_tokens"] if k else 0 for r, k in zip(records, ok)],
            "ttfts": [r["first_token_s"] - r["arrival_s"] if k else 0.0
                      for r, k in zip(records, ok)],
            "itls": [[b - a for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:])]
                     for r in records],
            "latencies": [r["finish_s"] - r["arrival_s"] if k else 0.0
                          for r, k in zip(records, ok)],
            "start_times": [r["arrival_s"] for r in records],
            "errors": [r.get("error") or "" for r in records]}


def result_path(a: argparse.Namespace, out: dict) -> Path:
    name = a.result_filename or (
        f"{a.label or out['backend']}-{a.request_rate}qps"
        f"{f'-concurrency{a.max_concurrency}' if a.max_concurrency else ''}-"
        f"{out['model_id'].split('/')[-1]}-{out['date']}.json")
    d = Path(a.result_dir or ".")
    d.mkdir(parents=True, exist_ok=True)
    return d / name


HEADERS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def format_result(res: dict, metrics: list[str], percentiles: list[float],
                  max_concurrency: int | None, request_rate: float) -> str:
    """The summary in vLLM's layout: a 40-column label, then the value."""
    def row(label: str, value) -> str:
        return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else \
            f"{label:<40} {value:<10}"
    lines = [f"{' Serving Benchmark Result ':=^50}", row("Successful requests:", res["completed"]),
             row("Failed requests:", res["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    lines += [row("Benchmark duration (s):", res["duration"]),
              row("Total input tokens:", res["total_input_tokens"]),
              row("Total generated tokens:", res["total_output_tokens"]),
              row("Request throughput (req/s):", res["request_throughput"]),
              row("Output token throughput (tok/s):", res["output_throughput"]),
              row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"]),
              row("Peak concurrent requests:", float(res["max_concurrent_requests"])),
              row("Total Token throughput (tok/s):", res["total_token_throughput"])]
    for m in metrics:
        short, header = HEADERS[m]
        lines += [f"{header:-^50}", row(f"Mean {short} (ms):", res[f"mean_{m}_ms"]),
                  row(f"Median {short} (ms):", res[f"median_{m}_ms"])]
        lines += [row(f"P{int(q) if int(q) == q else q} {short} (ms):",
                      res[f"p{int(q) if int(q) == q else q}_{m}_ms"]) for q in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)


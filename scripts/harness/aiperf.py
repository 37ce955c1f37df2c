"""aiperf (NVIDIA's serving benchmark, in the ``test`` extra) against an OpenAI-compatible
server: one profile through its own CLI in a subprocess (``run``), the figures of its JSON
export (``summary``) and its requests as the harness's records (``records``), so jserve's
formulas (``jserve.bench.metrics.serving_result``) can be applied to aiperf's timestamps.

What aiperf 0.13.0 needs to run offline here:
- a tokenizer directory given by its absolute path (aiperf treats it as local and asks the hub
  nothing) with ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` unset: with either set it looks
  the path up in the hub cache instead and fails (``HFValidationError``). ``run`` also points
  ``HF_ENDPOINT`` at a closed local port, so a hub call would fail rather than download.
  jserve's built-in model has no tokenizer files: ``write_byte_tokenizer`` writes an HF one
  that counts as its byte tokenizer does.
- nothing else from outside: its services (controller, dataset and timing managers, workers,
  record processors) are processes talking over ZMQ IPC sockets under ``TMPDIR``, whose
  paths must fit in 107 characters (a pytest ``tmp_path`` is too long; ``run`` gives each
  run a short directory of its own). Its scraping of the server's ``/metrics`` and its GPU telemetry
  (which reads ``localhost:9400``, jserve's default metrics port, as DCGM's) are turned off.

aiperf counts tokens with the server's ``usage`` (``--use-server-token-count``): its own count
re-tokenizes the streamed text, which differs from what a random-weight model generated.
Its "inter token latency" is per request, ``(latency - TTFT) / (output tokens - 1)``: vLLM's
TPOT; its "inter chunk latency" (each gap between chunks with text) is vLLM's ITL.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLOSED_HUB = "http://127.0.0.1:9"  # nothing listens there: any hub call fails at once


def command(url: str, model: str, tokenizer_dir: str | Path, out_dir: str | Path, *,
            endpoint_type: str = "chat", requests: int = 20, concurrency: int = 4,
            isl: int = 64, osl: int = 16, seed: int = 0, api_key: str | None = None
            ) -> list[str]:
    """``aiperf profile`` of ``requests`` streaming requests, ``concurrency`` at a time, of
    synthetic prompts of ``isl`` tokens (by the tokenizer) asking for exactly ``osl`` tokens
    (``ignore_eos``)."""
    cmd = ["aiperf", "profile", "--model", model, "--url", url,
           "--endpoint-type", endpoint_type, "--streaming",
           "--tokenizer", str(Path(tokenizer_dir).resolve()),
           "--request-count", str(requests), "--concurrency", str(concurrency),
           "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl), "--osl-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
           "--random-seed", str(seed), "--no-server-metrics", "--no-gpu-telemetry",
           "--ui", "none", "--artifact-dir", str(Path(out_dir).resolve())]
    return cmd + (["--api-key", api_key] if api_key else [])


def run(cmd: list[str], *, timeout: float = 1800, quiet: bool = True) -> dict:
    """Runs ``command``'s command line (as ``python -m aiperf``); its JSON export.
    ``quiet``: keep its console output (shown if it fails), else let it print. aiperf exits
    0 even when its services fail to start, so a run without its export is a failure."""
    import tempfile

    out_dir = Path(cmd[cmd.index("--artifact-dir") + 1])
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # Its IPC socket paths must fit in 107 characters: a short directory of its own.
    with tempfile.TemporaryDirectory(prefix="aiperf-", dir="/tmp") as tmp:
        env.update(HF_ENDPOINT=CLOSED_HUB, TMPDIR=tmp)
        done = subprocess.run([sys.executable, "-m", "aiperf", *cmd[1:]], env=env,
                              capture_output=quiet, text=True, timeout=timeout)
    export = out_dir / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.exists():
        tail = (done.stdout or "")[-3000:] + (done.stderr or "")[-3000:] if quiet else ""
        raise RuntimeError(f"aiperf exited {done.returncode}: {' '.join(cmd)}\n{tail}")
    return json.loads(export.read_text())


def errors(export: dict) -> int:
    return sum(e.get("count", 1) for e in export.get("error_summary") or ())


def summary(export: dict) -> dict[str, float]:
    """aiperf's own figures (latencies in seconds): requests done and failed, request and
    output-token throughput, TTFT, its per-request ITL (vLLM's TPOT) and its per-gap inter-chunk
    latency (vLLM's ITL) at P50 and P99, the run's duration."""
    def stat(name: str, key: str, scale: float = 1e-3) -> float:
        return export[name][key] * scale
    return {"ok": int(export["request_count"]["avg"]), "errored": errors(export),
            "req_s": stat("request_throughput", "avg", 1.0),
            "tok_s": stat("output_token_throughput", "avg", 1.0),
            "ttft_p50": stat("time_to_first_token", "p50"),
            "ttft_p99": stat("time_to_first_token", "p99"),
            "tpot_p50": stat("inter_token_latency", "p50"),
            "tpot_p99": stat("inter_token_latency", "p99"),
            "itl_p50": stat("inter_chunk_latency", "p50"),
            "itl_p99": stat("inter_chunk_latency", "p99"),
            "duration": stat("benchmark_duration", "avg", 1.0)}


def records(out_dir: str | Path) -> list[dict]:
    """aiperf's requests (its ``profile_export.jsonl``) as harness records, seconds from the
    first request's start: sent at its start, first token at its TTFT, a chunk after each of
    its inter-chunk latencies, finished at its request latency; failed ones with null times."""
    rows = [json.loads(line) for line in
            (Path(out_dir) / "profile_export.jsonl").read_text().splitlines() if line]
    t0 = min(r["metadata"]["request_start_ns"] for r in rows)
    out = []
    for r in rows:
        m, start = r["metrics"], (r["metadata"]["request_start_ns"] - t0) / 1e9
        ok = "error" not in r or not r["error"]
        first = start + m["time_to_first_token"]["value"] / 1e3 if ok else None
        chunks = [first] if ok else []
        for gap in (m.get("inter_chunk_latency") or {}).get("value") or ():
            chunks.append(chunks[-1] + gap / 1e3)
        out.append({"request_id": r["metadata"]["x_request_id"],
                    "prompt_tokens": m["usage_prompt_tokens"]["value"] if ok else 0,
                    "usage_prompt_tokens": m["usage_prompt_tokens"]["value"] if ok else None,
                    "output_tokens": m["usage_completion_tokens"]["value"] if ok else 0,
                    "arrival_s": start, "first_token_s": first,
                    "finish_s": start + m["request_latency"]["value"] / 1e3 if ok else None,
                    "finish_reason": "length" if ok else "abort",
                    "token_times_s": chunks, "chunk_times_s": chunks})
    return out


def write_byte_tokenizer(out_dir: str | Path) -> Path:
    """An HF tokenizer directory that encodes as jserve's built-in byte tokenizer
    (``jserve.tokenizer.ByteTokenizer``: a UTF-8 byte's value is its id, ``<bos>`` 256,
    ``<eos>`` 257, ``<pad>`` 258), so tools that need one (aiperf, guidellm) count the
    built-in model's tokens as it does (but for the specials' names written in a text: one
    token here, their bytes there)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from jserve.tokenizer import ByteTokenizer

    vocab = {c: b for b, c in _byte_chars(pre_tokenizers.ByteLevel.alphabet()).items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"<bos>": ByteTokenizer.BOS, "<eos>": ByteTokenizer.EOS,
                "<pad>": ByteTokenizer.PAD}
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", ByteTokenizer.BOS)])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": 1 << 30}))
    return out


def _byte_chars(alphabet: list[str]) -> dict[int, str]:
    """GPT-2's byte -> character table (printable bytes stand for themselves, the others
    for characters from 256 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    assert set(table.values()) == set(alphabet)
    return table

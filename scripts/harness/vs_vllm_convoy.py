"""The convoy over HTTP for ``scripts/bench_vs_vllm.py``: ``jserve serve`` (once per
``--jserve-scheduler``) and ``vllm serve`` (once per ``--vllm-bind``) on loopback, the same
checkpoint and limits; one long document streamed, then ``delay`` seconds later a burst of
short prompts, all over the OpenAI completions API (token-id prompts, so every server gets
exactly the same lengths; EOS ignored). A server that prefills the document before it looks
at the shorts makes them wait for all of it: their TTFT against the document's is the
convoy. The servers stay up and the repetitions alternate them, as the offline parts do."""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx2 as httpx

from harness.vs_vllm import HARNESS, ROOT, child_env, random_prompts, rotated, sides
from jserve.bench.metrics import percentile
from jserve.serving.engines import free_port

MODEL_NAME = "bench"  # --served-model-name of every server


class Server:
    """A server subprocess writing to its log, ready once /health answers 200."""

    def __init__(self, name: str, argv: list[str], env: dict, port: int, log: Path,
                 timeout: float):
        self.name, self.log, self.url = name, log, f"http://127.0.0.1:{port}"
        self.logf = log.open("a")
        self.proc = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT,
                                     env=env, cwd=ROOT)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self.logf.close()
                raise RuntimeError(f"{name} exited ({self.proc.returncode}) while starting: "
                                   f"{log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"{name}: not ready after {timeout:.0f} s (log: {log})")
            time.sleep(1.0)
        self.start_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


def server_argvs(a, model: Path) -> list[tuple[str, list[str], dict, int]]:
    """(name, argv, environment, port) of every server: jserve per scheduler, vLLM per
    binding, each on a free loopback port."""
    common = ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--dtype", a.dtype,
              "--max-model-len", str(a.max_model_len)]
    if a.max_num_batched_tokens:
        common += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    kv = str(int(a.kv_gib * (1 << 30)))
    out = []
    for side in sides(a):
        if side.kind == "jserve":
            for sched in a.jserve_scheduler:
                port = free_port()
                out.append((f"jserve[{sched}]", [
                    side.python, "-m", "jserve.cli", "serve", str(model), *common,
                    "--port", str(port), "--kv-cache-bytes", kv, "--scheduler", sched,
                    "--grpc-port", "0", "--metrics-port", "-1", "--log-level", "WARNING",
                    *a.jserve_serve_args.split()], child_env(side), port))
        else:
            port = free_port()
            out.append((side.name, [
                side.python, str(HARNESS / "vllm_shim.py"), "serve", str(model), *common,
                "--port", str(port), "--kv-cache-memory-bytes", kv, "--seed", "0",
                *a.vllm_serve_args.split()], child_env(side), port))
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int],
                  max_tokens: int) -> tuple[float, float, int]:
    """(sent, first token, tokens) of one streamed completion; times by perf_counter."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None and '"choices":[{' in line.replace(" ", ""):
                first = time.perf_counter()
            if '"completion_tokens"' in line:
                tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", 0)
    if first is None:
        raise RuntimeError(f"{url}: the stream held no token")
    return sent, first, tokens


async def convoy_once(url: str, doc: list[int], shorts: list[list[int]], max_tokens: int,
                      delay: float) -> dict:
    """The document, then after ``delay`` s every short at once: TTFTs and token counts."""
    async with httpx.AsyncClient(timeout=None) as client:
        doc_task = asyncio.create_task(_stream(client, url, doc, max_tokens))
        await asyncio.sleep(delay)
        got = await asyncio.gather(*(_stream(client, url, s, max_tokens) for s in shorts))
        d = await doc_task
    ttfts = [first - sent for sent, first, _ in got]
    return {"doc_ttft_s": d[1] - d[0], "short_ttft_s": ttfts,
            "short_ttft_p50_s": percentile(ttfts, 50), "short_ttft_p90_s": percentile(ttfts, 90),
            "tokens": [d[2]] + [n for *_, n in got]}


def run_convoy(a, model: Path, ids: list[int], step) -> dict:
    """Starts every server, warms each with a small convoy, then ``a.reps`` convoys per
    server, alternated; per server the medians of short TTFT P50 / P90 and document TTFT."""
    servers: dict[str, Server] = {}
    raw: dict[str, list[dict]] = {}
    try:
        for name, argv, env, port in server_argvs(a, model):
            step(f"starting {name}: {' '.join(argv[1:])}")
            servers[name] = s = Server(name, argv, env, port,
                                       a.out / f"serve-{name}.log", a.start_timeout)
            step(f"{name} ready in {s.start_s:.0f} s; warm-up convoy")
            warm = random_prompts(ids, 3, a.convoy_short_input, 3)
            doc = random_prompts(ids, 1, min(a.convoy_doc, 512), 4)[0]
            asyncio.run(convoy_once(s.url, doc, warm, 2, 0.0))
            raw[name] = []
        for rep in range(a.reps):
            doc = random_prompts(ids, 1, a.convoy_doc, 3000 + rep)[0]
            shorts = random_prompts(ids, a.convoy_shorts, a.convoy_short_input, 4000 + rep)
            for name in rotated(list(servers), rep):
                time.sleep(a.settle_s)
                r = asyncio.run(convoy_once(servers[name].url, doc, shorts, a.convoy_output,
                                            a.convoy_delay))
                raw[name].append(r)
                step(f"rep {rep + 1}/{a.reps} convoy   {name:16s} doc TTFT "
                     f"{r['doc_ttft_s']:.2f} s, shorts P50 {r['short_ttft_p50_s']:.2f} s "
                     f"P90 {r['short_ttft_p90_s']:.2f} s, tokens {r['tokens']}")
    finally:
        for s in servers.values():
            s.stop()
    return {name: {"short_ttft_p50_ms": 1e3 * statistics.median(
                       r["short_ttft_p50_s"] for r in rows),
                   "short_ttft_p90_ms": 1e3 * statistics.median(
                       r["short_ttft_p90_s"] for r in rows),
                   "doc_ttft_ms": 1e3 * statistics.median(r["doc_ttft_s"] for r in rows),
                   "start_s": servers[name].start_s, "reps": rows}
            for name, rows in raw.items()}


def convoy_table(convoy: dict) -> str:
    lines = ["| server | short TTFT P50 ms | short TTFT P90 ms | document TTFT ms "
             "| start s |", "|---|---:|---:|---:|---:|"]
    for name, r in convoy.items():
        lines.append(f"| {name} | {r['short_ttft_p50_ms']:,.0f} | {r['short_ttft_p90_ms']:,.0f} "
                     f"| {r['doc_ttft_ms']:,.0f} | {r['start_s']:.0f} |")
    return "\n".join(lines)


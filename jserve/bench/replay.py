"""Replay a trace against the live engine, in process (``run_local``), through the gRPC
service (``run_remote``) or through any OpenAI-compatible HTTP server (``run_http``: jserve's
own or another one a user runs), with real wall-clock arrivals: a request is submitted when its
arrival time comes, and its latency counts from then, queueing included.

Every request asks for exactly its trace's output length (greedy, EOS ignored), with random
prompt token ids of its trace's prompt length, drawn from ``seed``. The result is one record
per request in the trace format (``jserve.sim.trace.RECORD_FIELDS``) plus ``token_times_s``;
times are seconds from the start of the run. With ``window_s`` the run stops there: what has
not finished is aborted and keeps a null ``finish_s`` (and ``first_token_s`` if none came).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

import numpy as np
from tqdm import tqdm

from jserve.sampling.params import SamplingParams
from jserve.sim.trace import TraceRequest, empty_record

log = logging.getLogger(__name__)


def prompt_token_ids(trace: Sequence[TraceRequest], vocab_size: int, seed: int
                     ) -> list[list[int]]:
    """Random prompts of the trace's lengths, the same for every policy given the seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, t.prompt_tokens).tolist() for t in trace]


def request_params(t: TraceRequest) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=t.output_tokens, ignore_eos=True)


def _fill(rec: dict, token_times: list[float], finish_reason: str | None,
          tokens: int | None = None) -> None:
    """Token times (run-relative) and how the request ended; ``finish_s`` is the last token's
    time for requests that ended normally, null for those the window cut. ``tokens``: the
    output tokens the server reported (default: the token times')."""
    rec["token_times_s"] = token_times
    rec["output_tokens"] = len(token_times) if tokens is None else tokens
    rec["first_token_s"] = token_times[0] if token_times else None
    rec["finish_reason"] = finish_reason
    rec["finish_s"] = token_times[-1] if finish_reason in ("stop", "length") else None


def _sorted(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    return sorted(trace, key=lambda t: t.arrival_s)


def run_local(engine, trace: Sequence[TraceRequest], *, window_s: float | None = None,
              seed: int = 0, progress: bool = True,
              prompts: dict[str, list[int]] | None = None) -> list[dict]:
    """Drives ``engine`` (an ``LLMEngine``) from this thread: arrivals are admitted between
    steps, as a serving loop would. Every request is validated before the clock starts, so
    a trace the engine cannot hold fails at once instead of part way through. ``prompts``
    (token ids by request id, e.g. sharing a document): default random ones of the trace's
    lengths."""
    trace = _sorted(trace)
    policy = engine.config.scheduler
    prompts = (prompt_token_ids(trace, engine.model_config.vocab_size, seed) if prompts is None
               else [prompts[t.request_id] for t in trace])
    prepared = []
    for t, ids in zip(trace, prompts):
        try:
            prepared.append(engine.prepare(ids, request_params(t)))
        except ValueError as e:
            raise ValueError(f"trace request {t.request_id}: {e}") from None
    records = {t.request_id: empty_record(t, policy) for t in trace}
    bar = tqdm(total=len(trace), desc=policy, unit="req", disable=not progress, leave=False)
    t0 = time.monotonic()

    def done(out, cut: bool = False) -> None:
        _fill(records[out.request_id], [x - t0 for x in out.metrics.token_times],
              None if cut else out.finish_reason)
        records[out.request_id]["cached_tokens"] = out.metrics.cached_tokens
        bar.update()

    i = 0
    try:
        while True:
            now = time.monotonic()
            while i < len(trace) and t0 + trace[i].arrival_s <= now:
                t = trace[i]
                engine.enqueue(prepared[i], request_id=t.request_id,
                               arrival_time=t0 + t.arrival_s)
                i += 1
            if window_s is not None and now - t0 >= window_s:
                break
            if engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done(out)
            elif i < len(trace):
                time.sleep(max(0.0, t0 + trace[i].arrival_s - time.monotonic()))
            else:
                break
    finally:
        for rid in [t.request_id for t in trace[:i] if t.request_id in engine.requests]:
            done(engine.abort(rid), cut=True)
        while engine.has_unfinished():  # steps still on the device hold the aborted blocks
            engine.step()
        bar.close()
    return [records[t.request_id] for t in trace]


async def run_remote(target: str, trace: Sequence[TraceRequest], *,
                     window_s: float | None = None, seed: int = 0, progress: bool = True,
                     auth_token: str | None = None, concurrency: int | None = None
                     ) -> list[dict]:
    """The same against ``jserve serve`` at ``target``: one streaming Generate per request,
    token times taken as each streamed token arrives at the client. The window becomes each
    call's gRPC deadline, which the server turns into the request's deadline.
    ``concurrency``: at most that many requests in flight (a closed loop, as a benchmark
    client's N streams); a request's latency then counts from when it is sent."""
    import grpc

    from jserve.client import FINISH_REASONS, AsyncClient

    trace = _sorted(trace)
    async with AsyncClient(target, auth_token=auth_token) as client:
        info = await client.model_info(timeout=30)
        prompts = prompt_token_ids(trace, info.vocab_size, seed)
        records = {t.request_id: empty_record(t, info.scheduler) for t in trace}
        bar = tqdm(total=len(trace), desc=info.scheduler, unit="req", disable=not progress,
                   leave=False)
        loop = asyncio.get_running_loop()
        t0 = loop.time()  # the event loop's clock is monotonic

        async def one(t: TraceRequest, ids: list[int]) -> None:
            await asyncio.sleep(max(0.0, t0 + t.arrival_s - loop.time()))
            timeout = None if window_s is None else t0 + window_s - loop.time()
            times: list[float] = []
            reason = None
            try:
                if timeout is None or timeout > 0:
                    async for r in client.stream(ids, request_params(t), timeout=timeout,
                                                 request_id=t.request_id):
                        now = loop.time() - t0
                        times.extend([now] * len(r.token_ids))
                        if r.finish_reason:
                            reason = FINISH_REASONS[r.finish_reason]
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    log.warning("request %s failed: %s %s", t.request_id, e.code().name,
                                e.details())
                    reason = "abort"
            _fill(records[t.request_id], times, reason)
            bar.update()

        return await _all(one, trace, prompts, records, bar, concurrency,
                          lambda: loop.time() - t0)


async def _all(one, trace, prompts, records, bar, concurrency: int | None = None,
               clock=None) -> list[dict]:
    """Runs ``one(request, prompt ids)`` for every request at once, or with ``concurrency``
    at most that many at a time (in trace order; a request's ``arrival_s`` becomes when it
    got its turn, ``clock()``); records in trace order."""
    if concurrency is not None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        gate, run = asyncio.Semaphore(concurrency), one

        async def one(t: TraceRequest, ids: list[int]) -> None:
            async with gate:
                rec = records[t.request_id]
                rec["arrival_s"] = max(rec["arrival_s"], clock())
                await run(t, ids)
    try:
        await asyncio.gather(*(one(t, ids) for t, ids in zip(trace, prompts)))
    finally:
        bar.close()
    return [records[t.request_id] for t in trace]


HTTP_FALLBACK_VOCAB = 256  # ids every tokenizer has, for servers that do not say their vocab
GREEDY_FIELDS = {"temperature": 0, "ignore_eos": True}  # run_http's default request fields


async def run_http(url: str, trace: Sequence[TraceRequest], *, window_s: float | None = None,
                   seed: int = 0, progress: bool = True, auth_token: str | None = None,
                   model: str | None = None, concurrency: int | None = None,
                   prompts: dict[str, list[int] | str] | None = None,
                   endpoint: str = "/v1/completions", fields: dict | None = None
                   ) -> list[dict]:
    """The same through ``POST {url}{endpoint}`` with ``stream: true``: ``/v1/completions``
    (token-id or text prompts) or ``/v1/chat/completions`` (a text prompt as the user's
    message), ``max_tokens`` = the trace's output length, and ``fields`` (default greedy,
    ``ignore_eos``). ``prompts`` (by request id): default random token ids of the trace's
    lengths, from the model's ``vocab_size`` when /v1/models gives it (jserve does, so they
    equal the gRPC run's), else ids below 256. The model is ``model`` or the first of
    /v1/models. The window becomes each request's client timeout (the connection is dropped,
    which aborts the request on jserve). ``concurrency`` as ``run_remote``'s.

    A chunk with a choice counts as one token, or as its logprobs' tokens when the server
    sends them; the final ``usage`` (asked for) gives ``output_tokens`` when it came, and
    tokens it reports beyond the chunks count at the last chunk's time. Each record also has
    ``chunk_times_s`` (every chunk with a choice), ``usage_prompt_tokens`` (null without a
    usage), ``done_s`` (its stream closed) and ``error`` (why it failed, else null)."""
    import httpx2 as httpx

    trace = _sorted(trace)
    headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    fields = GREEDY_FIELDS if fields is None else fields
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=30)) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        info = r.json()["data"][0]
        model = model or info["id"]
        prompts = (prompt_token_ids(trace, info.get("vocab_size", HTTP_FALLBACK_VOCAB), seed)
                   if prompts is None else [prompts[t.request_id] for t in trace])
        label = info.get("scheduler", model)
        records = {t.request_id: empty_record(t, label) for t in trace}
        bar = tqdm(total=len(trace), desc=label, unit="req", disable=not progress, leave=False)
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(t: TraceRequest, prompt: list[int] | str) -> None:
            await asyncio.sleep(max(0.0, t0 + t.arrival_s - loop.time()))
            timeout = None if window_s is None else t0 + window_s - loop.time()
            rec = records[t.request_id]
            rec.update(chunk_times_s=[], usage_prompt_tokens=None, error=None)
            times: list[float] = []
            reason, tokens = None, None
            if timeout is None or timeout > 0:
                body = _http_body(endpoint, model, prompt, t.output_tokens, fields)
                try:
                    reason, tokens = await asyncio.wait_for(
                        _stream(client, endpoint, body, rec, times, lambda: loop.time() - t0),
                        timeout)
                except asyncio.TimeoutError:
                    pass
                except httpx.HTTPError as e:
                    reason, rec["error"] = "abort", f"{type(e).__name__}: {e}"
            if rec["error"]:
                log.warning("request %s failed: %s", t.request_id, rec["error"])
            _fill(rec, times, reason, tokens)
            rec["done_s"] = loop.time() - t0
            bar.update()

        return await _all(one, trace, prompts, records, bar, concurrency,
                          lambda: loop.time() - t0)


def _http_body(endpoint: str, model: str, prompt: list[int] | str, max_tokens: int,
               fields: dict) -> dict:
    body = {"model": model, "max_tokens": max_tokens, **fields, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint.rstrip("/").endswith("/chat/completions"):
        if not isinstance(prompt, str):
            raise ValueError(f"{endpoint} takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _stream(client, endpoint: str, body: dict, rec: dict, times: list[float], clock
                  ) -> tuple[str | None, int | None]:
    """One streamed request: fills ``times`` (a token's time each), the record's chunk times,
    prompt usage and error; its finish reason ("abort" when it failed) and the completion
    tokens the usage reported (None without one)."""
    import json

    reason, usage = None, None
    async with client.stream("POST", endpoint, json=body) as resp:
        if resp.status_code != 200:
            rec["error"] = f"HTTP {resp.status_code} {(await resp.aread())[:200]!r}"
            return "abort", None
        async for line in _sse_data(resp):
            chunk = json.loads(line)
            if "error" in chunk:
                rec["error"] = str(chunk["error"])
                return "abort", None
            now = clock()
            for c in chunk.get("choices") or ():
                rec["chunk_times_s"].append(now)
                lp = c.get("logprobs") or {}
                times.extend([now] * (len(lp.get("tokens") or lp.get("content") or ()) or 1))
                reason = c.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    if not usage:
        return reason, None
    rec["usage_prompt_tokens"] = usage.get("prompt_tokens")
    if times and usage["completion_tokens"] > len(times):
        times.extend([times[-1]] * (usage["completion_tokens"] - len(times)))
    return reason, usage["completion_tokens"]


async def _sse_data(resp):
    """The ``data:`` payloads of a server-sent event stream, ``[DONE]`` left out (split from the
    raw bytes: the client's line decoder would cost the machine the server runs on more)."""
    buf = b""
    async for part in resp.aiter_raw():
        buf += part
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and line.rstrip() != b"data: [DONE]":
                yield line[6:]

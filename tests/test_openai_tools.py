"""What tools built for vLLM's OpenAI server rely on, against a real ``jserve serve`` of an HF
checkpoint with its tokenizer: guidellm (the ``test`` extra) runs its synchronous and
concurrent profiles with no errors and exact output token counts; vLLM's
``stream_options.continuous_usage_stats`` puts usage on every chunk; ``--served-model-name``
names the model (several names, the first reported); and the SSE stream carries one chunk per
engine step per request, measured at concurrency 8 against the engine's own count."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Served
from harness import guidellm
from hf_models import tiny_llama_dir
from jserve.client import Client
from jserve.engine.config import AUTO_BURST_STEPS
from jserve.serving.app import ServerConfig
from jserve.serving.commands import served_model_names

pytestmark = pytest.mark.slow  # a server of its own, and guidellm's own start-up


@pytest.fixture(scope="module")
def served():
    s = Served("--model", str(tiny_llama_dir("llama2", with_tokenizer=True)),
               "--served-model-name", "a", "b", "--max-num-seqs", "8")
    yield s
    s.close()


def counters(url: str) -> dict[str, float]:
    body = httpx.get(url + "/metrics", timeout=30).text
    return {s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def engine_steps(url: str) -> tuple[float, float]:
    """(tokens generated, engine steps that gave some request tokens, summed over requests):
    the engine thread observes TTFT at a request's first such step and TPOT at every later
    one, so the two histograms' counts add up to the second."""
    c = counters(url)
    return (c["jserve_generation_tokens_total"], c["jserve_time_to_first_token_seconds_count"]
            + c["jserve_time_per_output_token_seconds_count"])


def chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


COMPLETION = {"model": "a", "prompt": "Hello, jserve", "max_tokens": 24, "temperature": 0,
              "ignore_eos": True}
CHAT = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
        "temperature": 0, "ignore_eos": True}
CONTINUOUS = {"stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


# -- served model names ----------------------------------------------------------------------
def test_served_model_names_first_reported_all_accepted_others_404(served):
    models = httpx.get(served.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["a"]
    assert served.line.startswith("jserve: serving a (--model ")
    for name in ("a", "b"):
        r = httpx.post(served.url + "/v1/completions", json={**COMPLETION, "model": name},
                       timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "a", r.text
        r = httpx.post(served.url + "/v1/chat/completions", json={**CHAT, "model": name},
                       timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "a", r.text
        assert r.json()["usage"]["completion_tokens"] == 24
    for name in ("c", "A", "llama2-float32-single-tok", str(tiny_llama_dir(
            "llama2", with_tokenizer=True))):  # the directory's name or path: not a name here
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            r = httpx.post(served.url + path, json={**body, "model": name}, timeout=30)
            assert r.status_code == 404, (name, r.text)
            assert "'a', 'b'" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", json={**COMPLETION, "model": ["a"]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    with Client(served.target) as c:
        info = c.model_info(timeout=30)
    assert info.model == "a" and list(info.served_model_names) == ["a", "b"]


def test_default_served_name_is_the_builtin_name_or_the_directory_name(tmp_path, monkeypatch):
    def names(model: str, given=None) -> tuple[str, ...]:
        return served_model_names(argparse.Namespace(model=model, served_model_name=given))
    assert names("default") == ("default",)
    assert names("tiny-tasks") == ("tiny-tasks",)
    assert names("/srv/models/Llama-3.1-8B/") == ("Llama-3.1-8B",)
    assert names(str(tmp_path / "ckpt")) == ("ckpt",)
    monkeypatch.chdir(tmp_path)
    assert names(".") == (tmp_path.name,)
    assert names("default", ["x", "y", "x"]) == ("x", "y")
    with pytest.raises(SystemExit):
        names("default", [""])
    assert ServerConfig(served_model_names=("x", "y")).model_name == "x"
    for bad in ("x", (), ("x", "")):
        with pytest.raises(ValueError, match="served_model_names"):
            ServerConfig(served_model_names=bad)


# -- continuous usage ------------------------------------------------------------------------
def test_continuous_usage_on_every_chunk_grows_by_its_tokens_to_the_final_usage(served):
    for path, body, tokens in (
            # logprobs: the chunk's tokens, counted independently of usage
            ("/v1/completions", {**COMPLETION, "logprobs": 0},
             lambda ch: len(ch["logprobs"]["tokens"])),
            ("/v1/chat/completions", {**CHAT, "logprobs": True},
             lambda ch: len(ch["logprobs"]["content"])),
            # no logprobs: the pre-serialized frame, one chunk per step (one token, or a
            # decode burst's: 1 to AUTO_BURST_STEPS, the only bound known without them)
            ("/v1/completions", COMPLETION, None),
            ("/v1/chat/completions", CHAT, None)):
        got = chunks(served.url, path, {**body, **CONTINUOUS})
        *content, final = got
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 24
        prompt = final["usage"]["prompt_tokens"]
        assert prompt > 0 and len(content) > 1
        n = 0
        for ch in content:
            if tokens is None:
                step = ch["usage"]["completion_tokens"] - n
                assert 1 <= step <= AUTO_BURST_STEPS, (path, ch)
                n += step
            else:
                n += tokens(ch["choices"][0])
            assert ch["usage"] == {"prompt_tokens": prompt, "completion_tokens": n,
                                   "total_tokens": prompt + n}, (path, ch)
        assert content[-1]["usage"] == final["usage"]
        assert content[-1]["choices"][0]["finish_reason"] == "length"
    # n=2: each chunk counts its own choice, as vLLM does; the last chunk the request's sum.
    got = chunks(served.url, "/v1/completions", {**COMPLETION, **CONTINUOUS, "n": 2,
                                                 "max_tokens": 8, "logprobs": 0})
    seen = {0: 0, 1: 0}
    for ch in got[:-1]:
        c = ch["choices"][0]
        seen[c["index"]] += len(c["logprobs"]["tokens"])
        assert ch["usage"]["completion_tokens"] == seen[c["index"]]
    assert seen == {0: 8, 1: 8} and got[-1]["usage"]["completion_tokens"] == 16
    assert got[-1]["usage"]["prompt_tokens"] == got[0]["usage"]["prompt_tokens"]
    # Without it, usage is null on every chunk but the last (as before).
    got = chunks(served.url, "/v1/completions", {**COMPLETION, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    assert all(ch["usage"] is None for ch in got[:-1]) and got[-1]["usage"]
    for options in ({"continuous_usage_stats": True}, {"include_usage": True,
                                                       "continuous_usage_stats": 1}):
        r = httpx.post(served.url + "/v1/completions", timeout=30, json={
            **COMPLETION, "stream": True, "stream_options": options})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


# -- a chunk per engine step -----------------------------------------------------------------
STREAMS, REQUESTS, TOKENS = 8, 32, 64


async def _stream_all(url: str) -> list[int]:
    """Tokens of every content chunk of REQUESTS streams, STREAMS at a time."""
    sizes: list[int] = []
    gate = asyncio.Semaphore(STREAMS)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def one(i: int) -> None:
            body = {**COMPLETION, **CONTINUOUS, "prompt": f"request {i}: " + "ab " * (i % 9),
                    "max_tokens": TOKENS}
            done = 0
            async with gate, client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ch = json.loads(line[6:])
                        if ch["choices"]:
                            sizes.append(ch["usage"]["completion_tokens"] - done)
                            done += sizes[-1]
            assert done == TOKENS
        await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    return sizes


def test_one_sse_chunk_per_engine_step_at_concurrency_8(served):
    tokens0, steps0 = engine_steps(served.url)
    sizes = asyncio.run(_stream_all(served.url))
    tokens1, steps1 = engine_steps(served.url)
    assert sum(sizes) == tokens1 - tokens0 == REQUESTS * TOKENS
    per_chunk = sum(sizes) / len(sizes)
    per_step = (tokens1 - tokens0) / (steps1 - steps0)
    print(f"tokens per SSE chunk {per_chunk:.3f} (max {max(sizes)}), engine tokens per step "
          f"per request {per_step:.3f}")
    assert abs(per_chunk / per_step - 1) <= 0.10, (per_chunk, per_step)
    # Exactly: no client here is slow enough to hold a send up, so no step was merged.
    assert len(sizes) == steps1 - steps0


def test_small_writes_are_not_held_for_the_clients_delayed_ack(served):
    """Nagle is off on the HTTP API's connections: with it on, a response's second write (a
    body after its headers, an SSE event after the last) waited for the client's delayed ACK,
    about 40 ms on Linux, on every request of a kept-alive connection but the first."""
    with httpx.Client(base_url=served.url, timeout=30) as c:
        c.get("/health")
        times = []
        for _ in range(10):
            t = time.perf_counter()
            assert c.get("/health").status_code == 200
            times.append(time.perf_counter() - t)
    assert sorted(times)[len(times) // 2] < 0.02, times


def test_a_client_that_does_not_read_gets_its_backlog_merged_and_holds_nothing_up(served):
    """Back-pressure: 8 choices x 480 tokens with 20 top logprobs each (about 7 MB of events,
    past what the kernel and the transport buffer) to a client that reads nothing until the
    engine has finished every choice: the engine did not wait for it, and what piled up
    meanwhile arrives merged into fewer chunks, every token and character there."""
    n, tokens = 8, 480
    body = {**CHAT, **CONTINUOUS, "n": n, "max_tokens": tokens, "logprobs": True,
            "top_logprobs": 20}
    want = httpx.post(served.url + "/v1/chat/completions", json={**CHAT, "max_tokens": tokens},
                      timeout=120).json()["choices"][0]["message"]["content"]
    length = 'jserve_requests_total{"outcome": "length"}'
    before = counters(served.url)[length]
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body,
                      timeout=300) as r:
        assert r.status_code == 200
        deadline = time.monotonic() + 240
        while counters(served.url)[length] < before + n:  # finished on the engine, unread
            assert time.monotonic() < deadline
            time.sleep(0.2)
        got = [json.loads(line[6:]) for line in r.iter_lines()
               if line.startswith("data: {")]
    texts, counts, sizes = [""] * n, [0] * n, []
    for ch in got[:-1]:
        c = ch["choices"][0]
        i = c["index"]
        texts[i] += c["delta"].get("content", "")
        sizes.append(len(c["logprobs"]["content"]))
        counts[i] += sizes[-1]
        assert ch["usage"]["completion_tokens"] == counts[i]
    assert counts == [tokens] * n and texts == [want] * n
    assert got[-1]["usage"]["completion_tokens"] == n * tokens
    print(f"{len(sizes)} chunks for {n * tokens} tokens, the largest {max(sizes)}")
    # What the buffers took went one chunk a step; the rest waited for the client, merged.
    assert len(sizes) < 0.8 * n * tokens and max(sizes) >= 100, (len(sizes), max(sizes))


# -- guidellm --------------------------------------------------------------------------------
PROMPT, OUTPUT = 32, 16


def test_guidellm_synchronous_and_concurrent_profiles(served, tmp_path):
    before = counters(served.url)
    model_dir = tiny_llama_dir("llama2", with_tokenizer=True)

    def run(profile: str, n: int) -> dict:
        return guidellm.run(served.url, model_dir, profile, n, PROMPT, OUTPUT,
                            tmp_path / f"{n}.json", workers=2, timeout=600)
    sync, conc = run("synchronous", 6), run("concurrent,streams=8", 32)
    after = counters(served.url)
    for bench, n in ((sync, 6), (conc, 32)):
        made = guidellm.requests_made(bench)
        assert made == {"successful": n, "errored": 0, "incomplete": 0, "total": n}, made
        done = bench["requests"]["successful"]
        assert len(done) == n and not bench["requests"]["errored"]
        assert [r["output_metrics"]["text_tokens"] for r in done] == [OUTPUT] * n
        assert bench["metrics"]["output_token_count"]["successful"]["total_sum"] == OUTPUT * n
        assert all(r["input_metrics"]["text_tokens"] >= PROMPT for r in done)
        figures = guidellm.summary(bench)
        assert (figures["ok"], figures["errored"]) == (n, 0) and figures["tok_s"] > 0
        recs = guidellm.records(bench)
        assert all(0 <= r["arrival_s"] < r["first_token_s"] <= r["finish_s"] for r in recs)
    assert conc["config"]["strategy"]["streams"] == 8
    # guidellm's counts are the server's: 38 requests, every one finished at its length.
    assert after["jserve_generation_tokens_total"] - before["jserve_generation_tokens_total"] \
        == OUTPUT * 38
    length = 'jserve_requests_total{"outcome": "length"}'
    assert after[length] - before.get(length, 0) == 38

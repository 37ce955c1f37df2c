"""The engine core in a process of its own (``jserve serve --engine-process``): a transformers-
written Llama with its trained tokenizer behind the real server and the official ``openai``
client gives the offline engine's text, streamed or not, stop strings and refusals included;
disconnects leave no KV page; the metrics are the engine thread's; a shutdown ends what is in
flight UNAVAILABLE and a killed core ends it INTERNAL (health fails, nothing hangs); the
front end's process never imports JAX. And the two pieces the parent's intake stands on: a
tokenizer that crosses processes whole, an empty pool of the engine's geometry."""
from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest

from conftest import gauges, wait_idle
from hf_models import llama3_chat_dir
from jserve import SamplingParams
from jserve.cache.allocator import PageAllocator
from jserve.cache.hybrid import HybridAllocator
from jserve.engine.requests.intake import RequestIntake
from jserve.fields import FieldError
from jserve.serving.app import BackgroundServer, ServerConfig
from jserve.serving.engine_api import (
    ALREADY_EXISTS,
    INTERNAL,
    UNAVAILABLE,
    Delta,
    EngineClient,
)
from jserve.serving.live_engine import EngineSpec
from jserve.serving.process_engine import ProcessEngine, _Stream, for_core
from jserve.tokenizer import HFTokenizer
from llm_helpers import SMALL, small_llm

NAME = "llama"


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def model() -> str:
    return str(llama3_chat_dir())


@pytest.fixture(scope="module")
def offline(model):
    return small_llm(model)


@pytest.fixture(scope="module")
def bg(model):
    engine = ProcessEngine(EngineSpec(model, llm_kwargs=dict(SMALL)))
    assert isinstance(engine, EngineClient)
    server = BackgroundServer(engine, ServerConfig(host="127.0.0.1", port=0, metrics_port=None,
                                                   http_port=0, served_model_names=(NAME,)))
    yield server
    server.stop(grace=0)


@pytest.fixture(scope="module")
def oai(bg):
    with openai.OpenAI(base_url=bg.http_url + "/v1", api_key="-", max_retries=0,
                       timeout=120) as c:
        yield c


def test_text_streamed_or_not_is_the_offline_engines(bg, oai, offline):
    want = offline.generate("The quick brown fox", greedy(16))[0]
    got = oai.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=16,
                                 temperature=0, extra_body={"ignore_eos": True})
    chunks = list(oai.completions.create(model=NAME, prompt="The quick brown fox",
                                         max_tokens=16, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}))
    assert got.choices[0].text == want.text
    assert "".join(c.choices[0].text for c in chunks) == want.text and len(chunks) > 2
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        len(want.prompt_token_ids), 16)
    msgs = [{"role": "user", "content": "hi"}]
    chat = offline.generate(offline.chat_prompt(msgs), greedy(12))[0]
    assert oai.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True}).choices[0].message.content == chat.text
    # A stop string the engine completes mid-stream cuts the text where it starts.
    stop = want.text[4:7]
    assert stop.strip() and stop not in want.text[:4]
    cut = list(oai.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=16,
                                      temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in cut) == want.text[:want.text.index(stop)]
    assert cut[-1].choices[0].finish_reason == "stop"


def test_stop_strings_found_by_the_front_end_cut_where_the_engine_cuts(bg, oai, offline):
    """The text is made in the front end's process: a stop string ends the request at the
    token the offline engine ends it at (mid-stream, at min_tokens, at the last token the
    core would make anyway), with the same usage, its pages freed, and the request's
    histograms counting the tokens the client got."""
    prompt, n = "Once upon a time", 24
    text = offline.generate(prompt, greedy(n))[0].text
    k = next(k for k in range(2, 8) if text.find(text[-k:]) == len(text) - k)
    cases = [(text[3:6], 0), (text[10:12], 0), (text[3:6], 8), (text[-k:], 0)]
    before = gauges(bg.http_url)
    for stop, min_tokens in cases:
        want = offline.generate(prompt, greedy(n, stop=[stop], min_tokens=min_tokens))[0]
        chunks = list(oai.completions.create(
            model=NAME, prompt=prompt, max_tokens=n, temperature=0, stop=[stop],
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": min_tokens}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            want.finish_reason
        assert chunks[-1].usage.completion_tokens == want.num_tokens
    assert [w for w in cases[:3] if w[0] in text[:3]] == []  # (each stop is met mid-text)
    assert wait_idle(bg)["pages_used"] == 0
    after = gauges(bg.http_url)
    wants = [offline.generate(prompt, greedy(n, stop=[s], min_tokens=m))[0].num_tokens
             for s, m in cases]
    assert after["jserve_request_generation_tokens_count"] == \
        before["jserve_request_generation_tokens_count"] + len(cases)
    assert after["jserve_request_generation_tokens_sum"] == \
        before["jserve_request_generation_tokens_sum"] + sum(wants)
    assert wants[0] < wants[2] and wants[3] == n  # min_tokens moves the cut; the last token
    # The core stops where the front end found the stop, not at max_tokens.
    made = after["jserve_generation_tokens_total"]
    got = oai.completions.create(model=NAME, prompt=prompt, max_tokens=400, temperature=0,
                                 stop=[cases[0][0]], extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == wants[0] and got.choices[0].finish_reason == "stop"
    assert wait_idle(bg)["pages_used"] == 0
    assert gauges(bg.http_url)["jserve_generation_tokens_total"] - made < 100


def test_a_stream_cut_here_waits_for_the_cores_last_delta_and_drops_what_follows(model):
    """The front end's side of a cut (constructed deltas, the real tokenizer): the tokens
    past the stop never reach the client; the core's last delta gives the usage of those
    sent, even when the core had ended the request first (by length); an error after a
    cut stays an error."""
    tok = HFTokenizer(model)
    ids = tok.encode(" one two three four five six", add_special_tokens=False)
    stop_tok = next(i for i in range(1, len(ids) + 1) if "three" in tok.decode(ids[:i]))
    params = SamplingParams(max_tokens=40, stop=["three"])
    for last in (Delta(ids[stop_tok:], "", [], finish_reason="length", prompt_tokens=3,
                       completion_tokens=len(ids), timings={"e2e_seconds": 1.0}),
                 Delta(ids[stop_tok:], "", [], error=(UNAVAILABLE, "shutting down"))):
        stream = _Stream(None, "r", params, tok, tok.eos_token_ids)
        first, stop = stream.take(Delta(ids[:stop_tok - 1], "", []))
        assert not stop and tok.decode(ids[:stop_tok - 1]).startswith(first.text)
        cut, stop = stream.take(Delta(ids[stop_tok - 1:], "", []))
        assert stop and cut.token_ids == ids[stop_tok - 1:stop_tok]
        assert first.text + cut.text == " one two "
        assert stream.take(Delta(ids[:2], "", [])) == (None, False)  # the core ran on
        end, stop = stream.take(last)
        assert not stop and end.token_ids == [] and end.text == ""
        if last.error is None:
            assert (end.finish_reason, end.completion_tokens) == ("stop", stop_tok)
            assert end.timings == last.timings and end.prompt_tokens == 3
        else:
            assert end.error == last.error and end.finish_reason is None
    # A stop string met in the core's own last delta ends it there too.
    stream = _Stream(None, "r", params, tok, tok.eos_token_ids)
    end, stop = stream.take(Delta(list(ids), "", [], finish_reason="length",
                                  completion_tokens=len(ids)))
    assert not stop and end.text == " one two " and end.token_ids == ids[:stop_tok]
    assert (end.finish_reason, end.completion_tokens) == ("stop", stop_tok)
    # The core is sent no stop strings and makes no text.
    core = for_core(RequestIntake(tok, 1000, 512, PageAllocator(9, 16)).prepare("hi", params))
    assert core.params.stop == () and core.params.detokenize is False
    assert core.params.max_tokens == 40


def test_refusals_name_their_field_and_leave_the_core_whole(bg, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=NAME, prompt="hi", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens" and "context of 512" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=NAME, prompt="hi", max_tokens=4,
                               extra_body={"structured_outputs": {"regex": "a[bc"}})
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="no-such-adapter", prompt="hi", max_tokens=4)
    # The core is the one check of request ids: a second stream of a live id is refused.
    engine = bg.server.engine
    prepared = engine.prepare("hello", greedy(64))

    async def twice():
        first = engine.submit("same", prepared, arrival_time=time.monotonic())
        second = engine.submit("same", prepared, arrival_time=time.monotonic())
        refused, streamed = await second.get(), await first.get()
        engine.abort("same")  # (the first: nothing more is sent to it)
        return refused, streamed
    refused, first = bg.run(twice())
    assert refused.error[0] == ALREADY_EXISTS and refused.last
    assert first.error is None
    assert wait_idle(bg)["pages_used"] == 0


def test_disconnects_free_every_page_and_the_metrics_are_the_engines(bg, oai):
    before = gauges(bg.http_url)
    for _ in range(3):
        with httpx.stream("POST", bg.http_url + "/v1/completions", timeout=60, json={
                "model": NAME, "prompt": "Once upon a time", "max_tokens": 200,
                "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())  # one event, then the client is gone
    oai.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body={
        "structured_outputs": {"choice": ["yes", "no"]}})
    st = wait_idle(bg)
    assert (st["pages_used"], st["in_flight"]) == (0, 0)
    deadline = time.monotonic() + 5
    while True:  # the scrape-time counters arrive with the core's next snapshot
        after = gauges(bg.http_url)
        if after["jserve_grammar_compiles_total"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after["jserve_grammar_compiles_total"] >= 1
    assert after["jserve_time_to_first_token_seconds_count"] >= \
        before["jserve_time_to_first_token_seconds_count"] + 4
    assert after["jserve_prompt_tokens_total"] > before["jserve_prompt_tokens_total"]
    assert after["jserve_kv_blocks_used"] == 0
    assert after["jserve_kv_blocks_free"] == st["pages_free"]


async def _first_then(engine: ProcessEngine, act) -> list:
    """Streams one long request on the started ``engine``; after its first delta ``act()``;
    returns the deltas."""
    sink = engine.submit("long", engine.prepare("Once upon a time", greedy(400)),
                         arrival_time=time.monotonic())
    deltas = [await sink.get()]
    act()
    while not deltas[-1].last:
        deltas.append(await asyncio.wait_for(sink.get(), 30))
    return deltas


def test_a_shutdown_ends_the_streams_in_flight_unavailable():
    engine = ProcessEngine(EngineSpec("default", llm_kwargs=dict(SMALL)))

    async def run():
        engine.start()
        return await _first_then(engine, lambda: engine.shutdown(10))
    deltas = asyncio.run(run())
    assert deltas[-1].error[0] == UNAVAILABLE
    assert sum(len(d.token_ids) for d in deltas) < 400
    assert engine._proc.returncode == 0 and not engine.alive


def _wait_stopped(pid: int) -> None:
    """Until ``pid`` is stopped (its state ``T`` in /proc)."""
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the core did not stop"
        time.sleep(0.01)


def test_a_killed_core_ends_the_streams_internal_and_reports_it():
    # (lars: a deadline policy, whose prompts have an isolated prefill time to ask for)
    engine = ProcessEngine(EngineSpec("default", llm_kwargs=dict(SMALL, scheduler="lars")))
    crashed = []

    async def run():
        loop = asyncio.get_running_loop()
        engine.start(loop, on_crash=crashed.append)
        engine.ISOLATED_WAIT_S = 0.3
        assert engine.isolated_prefill_s(100) > 0
        os.kill(engine.pid, signal.SIGSTOP)  # a hung core holds no intake thread
        _wait_stopped(engine.pid)  # (a signal lands a moment after kill() returns)
        t0 = time.monotonic()
        assert engine.isolated_prefill_s(100) == 0.0 and time.monotonic() - t0 < 2
        os.kill(engine.pid, signal.SIGCONT)
        return await _first_then(engine, lambda: os.kill(engine.pid, signal.SIGKILL))
    deltas = asyncio.run(run())
    assert deltas[-1].error[0] == INTERNAL and "exited" in deltas[-1].error[1]
    assert len(crashed) == 1 and not engine.alive
    assert engine.isolated_prefill_s(100) == 0.0  # (gone: no floor, the submit refuses)

    async def after():
        sink = engine.submit("later", engine.prepare("hi", greedy(4)),
                             arrival_time=time.monotonic())
        refused = await sink.get()
        with pytest.raises(RuntimeError, match="gone"):
            await engine.stats()
        return refused
    assert asyncio.run(after()).error[0] == INTERNAL


def test_the_front_ends_process_never_imports_jax():
    code = ("import sys\n"
            "from jserve.serving.live_engine import EngineSpec\n"
            "from jserve.serving.process_engine import ProcessEngine\n"
            "e = ProcessEngine(EngineSpec('default', llm_kwargs={'max_model_len': 128, "
            "'warmup': False}))\n"
            "print(e.tokenize('hi'), e.info.max_model_len, 'jax' in sys.modules)\n"
            "e.shutdown(10)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["128", "False"]


# -- what the parent's intake stands on --------------------------------------------------------
def test_a_tokenizer_crosses_processes_with_its_chat_template(model):
    tok = HFTokenizer(model)
    tok.set_chat_template("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    back = pickle.loads(pickle.dumps(tok))
    assert back.encode("hello world") == tok.encode("hello world")
    assert back.eos_token_ids == tok.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert back.apply_chat_template(msgs) == tok.apply_chat_template(msgs) == "<hi>"


@pytest.mark.parametrize("live", [
    PageAllocator(9, 16),
    PageAllocator(5, 16, groups=2, pages_per_group=4),
    PageAllocator(4, 16, window=40, max_chunk=8),
    HybridAllocator(9, 4, 16, 40, max_chunk=8),
], ids=["plain", "groups", "window", "hybrid"])
def test_an_empty_pool_of_the_engines_geometry_refuses_what_the_engine_does(live):
    blank = pickle.loads(pickle.dumps(live.blank()))
    assert type(blank) is type(live) and blank.num_allocated == 0
    live.allocate(2)  # what the live pool holds does not change what a request may need
    verdicts = []
    for pool in (live, blank):
        intake = RequestIntake(None, 100, 4096, pool)
        got = []
        for n in (10, 100, 130, 200, 400, 1000):
            try:
                intake.validate([1] * n, SamplingParams(max_tokens=8))
                got.append(None)
            except FieldError as e:
                got.append((e.field, str(e)))
        verdicts.append(got)
    assert verdicts[0] == verdicts[1] and None in verdicts[0] and any(verdicts[0])

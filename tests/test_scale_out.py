"""``jserve serve --data-parallel-size 3 --prefill-engines 1 --disaggregation always`` on
loopback ports (three engine processes behind the front end), and one engine started with
``--kv-transfer-config`` in vLLM's shape, pulling from peers that fail.

- Through the front end every prompt is prefilled on the prefill engine and decoded on a
  decode engine from the pages it pulled: the greedy tokens are the ones the prefill engine
  gives on its own, for completions (a prompt longer than a prefill chunk too) and for a
  streamed chat. Every page ends free or idle cached on each engine.
- With the prefill engine killed, the decode engines take every request colocated, with the
  same tokens; a decode engine killed mid-stream ends its stream with an error event and the
  other takes the next request; with the last one drained the front end answers 503.
- Two processes by vLLM's protocol (a proxy's prefill request to a producer, then the
  request to a consumer pulling from it), int8 pages: the producer's tokens.
- A pull that fails (the peer dies mid-body, answers 500, sends garbage, is too slow, or is
  not there) is counted by reason and the prompt is computed where it is: the same tokens. A
  ``remote_url`` that is not a peer is a 400 (the engine fetches only from its peers).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Served
from jserve import SamplingParams
from jserve.client import Client
from jserve.serving.front import merge_metrics

pytestmark = pytest.mark.slow
MODEL = "default"
SHORT = "count the apples in the basket"
LONG = "a long document about apples. " * 12  # 360 byte tokens: twelve prefill chunks
FLAGS = ("--max-model-len", "512")


def _counters(url: str, prefix: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.startswith(prefix) and s.name.endswith("_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _complete(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _chat(url: str, stream: bool) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": SHORT + " twice"}],
            "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                assert "error" not in d, d
                text += d["choices"][0]["delta"].get("content") or ""
    return text


def _pages_used(url: str) -> int:
    return httpx.get(url + "/server_info", timeout=10).json()["kv_pages"]["pages_used"]


# -- the front end and its three engines ----------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    s = Served("--data-parallel-size", "3", "--prefill-engines", "1",
               "--disaggregation", "always", *FLAGS)
    yield s
    s.stop(60)


def _engines(front: Served) -> list[dict]:
    return httpx.get(front.url + "/v1/engines", timeout=10).json()


def test_the_front_end_starts_one_prefill_and_two_decode_engines(cluster):
    engines = _engines(cluster)
    assert [(e["role"], e["state"]) for e in engines] == [
        ("prefill", "ready"), ("decode", "ready"), ("decode", "ready")]
    roles = [httpx.get(e["url"] + "/server_info", timeout=10).json()["kv_role"]
             for e in engines]
    assert roles == ["kv_producer", "kv_consumer", "kv_consumer"]


def test_disaggregated_tokens_are_the_prefill_engines_own(cluster):
    prefill = _engines(cluster)[0]["url"]
    before = _counters(cluster.url, "jserve_kv_transfer_pages")
    for prompt in (SHORT, LONG):
        want = _text(_complete(prefill, prompt))  # computed and decoded on one engine
        r = _complete(cluster.url, prompt)
        assert r.headers["x-jserve-engine"] in ("engine1", "engine2")
        assert _text(r) == want
        last = httpx.get(cluster.url + "/v1/route/decisions", timeout=10).json()[-1]
        assert last["prefill"] == 0 and last["decode"] in (1, 2)
    after = _counters(cluster.url, "jserve_kv_transfer_pages")
    imported = ("jserve_kv_transfer_pages_total", (("direction", "imported"),))
    # SHORT: 29 tokens, one full page before its last token's; LONG: 359 // 16 = 22
    assert after[imported] - before.get(imported, 0) == 1 + 22


def test_a_streamed_chat_gives_the_tokens_of_a_whole_one(cluster):
    whole = _chat(cluster.url, stream=False)
    assert _chat(cluster.url, stream=True) == whole
    assert whole == _chat(_engines(cluster)[0]["url"], stream=False)


def test_grpc_through_the_front_end_gives_the_http_tokens(cluster):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with Client(cluster.target) as c:
        got = c.generate(LONG + " over gRPC", params)
        assert c.model_info().max_model_len == 512
    assert got.text == _text(_complete(cluster.url, LONG + " over gRPC"))
    last = httpx.get(cluster.url + "/v1/route/decisions", timeout=10).json()[-2]
    assert last["prefill"] is None  # gRPC is placed colocated


def test_responses_follow_their_previous_response_to_its_engine(cluster):
    """Stored responses stay on the engine that made them: a follow-up
    (``previous_response_id``) and a GET go there, while new ones are placed."""
    async def create(i: int, stream: bool) -> tuple[str, str]:
        body = {"model": MODEL, "input": f"{SHORT} {i}", "max_output_tokens": 4,
                "temperature": 0, "stream": stream}
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(cluster.url + "/v1/responses", json=body)
        assert r.status_code == 200, r.text
        rid = (r.json()["id"] if not stream else
               json.loads(r.text.split("data: ", 2)[1].split("\n")[0])["response"]["id"])
        return rid, r.headers["x-jserve-engine"]

    async def made():
        return await asyncio.gather(*(create(i, stream=i % 2 == 1) for i in range(6)))
    made = asyncio.run(made())
    assert {e for _, e in made} == {"engine1", "engine2"}  # placed on both
    for rid, engine in made:
        r = httpx.post(cluster.url + "/v1/responses", timeout=120, json={
            "model": MODEL, "input": "and then?", "previous_response_id": rid,
            "max_output_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.headers["x-jserve-engine"] == engine
        got = httpx.get(cluster.url + f"/v1/responses/{rid}", timeout=10)
        assert got.status_code == 200 and got.headers["x-jserve-engine"] == engine


def test_every_page_ends_free_or_cached_on_every_engine(cluster):
    time.sleep(0.5)  # the last request's pages go back when its step ends
    assert [_pages_used(e["url"]) for e in _engines(cluster)] == [0, 0, 0]


def test_metrics_of_the_front_end_label_each_engine(cluster):
    c = _counters(cluster.url, "jserve_")
    assert c[("jserve_front_placements_total", (("placement", "disaggregated"),))] >= 4
    exported = [v for (n, labels), v in c.items() if n == "jserve_kv_transfer_pages_total"
                and dict(labels).get("direction") == "exported"]
    # engine0's and the sum's
    assert len(exported) == 2 and exported[0] == exported[1] >= 23


def test_with_the_prefill_engine_killed_the_decode_engines_serve_colocated(cluster):
    prefill = _engines(cluster)[0]
    want = _text(_complete(prefill["url"], SHORT + " and pears"))
    os.kill(prefill["pid"], signal.SIGKILL)
    end = time.monotonic() + 30
    while _engines(cluster)[0]["state"] != "dead":
        assert time.monotonic() < end, "the front end did not see the engine die"
        time.sleep(0.1)
    got = [_complete(cluster.url, SHORT + " and pears") for _ in range(2)]
    assert [_text(r) for r in got] == [want, want]
    decisions = httpx.get(cluster.url + "/v1/route/decisions", timeout=10).json()[-2:]
    assert [d["prefill"] for d in decisions] == [None, None]


def test_a_decode_engine_killed_mid_stream_ends_the_stream_with_an_error(cluster):
    body = {"model": MODEL, "prompt": SHORT, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        name = r.headers["x-jserve-engine"]
        victim = next(e for e in _engines(cluster) if e["name"] == name)
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    os.kill(victim["pid"], signal.SIGKILL)
    assert events[-1] == "[DONE]"
    assert "failed mid-response" in json.loads(events[-2])["error"]["message"]
    end = time.monotonic() + 30
    while next(e for e in _engines(cluster) if e["name"] == name)["state"] != "dead":
        assert time.monotonic() < end
        time.sleep(0.1)
    r = _complete(cluster.url, SHORT)
    assert r.status_code == 200 and r.headers["x-jserve-engine"] != name
    c = _counters(cluster.url, "jserve_front_failed")
    assert c[("jserve_front_failed_total", (("reason", "engine_died"),))] == 1


def test_a_drained_engine_takes_no_more_requests(cluster):
    last = next(e for e in _engines(cluster) if e["state"] == "ready")
    r = httpx.post(cluster.url + f"/v1/engines/{last['index']}/drain", timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "draining"
    r = _complete(cluster.url, SHORT)
    assert r.status_code == 503 and "no engine takes requests" in r.json()["error"]["message"]
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 503


# -- one engine pulling pages from peers that fail --------------------------------------------
class _Peer(BaseHTTPRequestHandler):
    """``/cut``: dies mid-body; ``/error``: 500; ``/garbage``: 200 with bytes that are not
    pages; ``/slow``: answers after the puller's timeout."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["content-length"]))
        kind = self.path.split("/")[1]
        if kind == "slow":
            time.sleep(3)
        if kind == "error":
            self.send_response(500)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        body = b"\x00\x00\x00\x02{}" + b"x" * 64
        try:
            self.send_response(200)
            self.send_header("content-type", "application/octet-stream")
            self.send_header("content-length", str(len(body) * (4 if kind == "cut" else 1)))
            self.end_headers()
            self.wfile.write(body)
            if kind == "cut":
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
        except (BrokenPipeError, ConnectionResetError):  # /slow: the puller gave up
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def peers():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kv_config(role: str, peers: list[str] = (), timeout_s: float = 30.0) -> str:
    return json.dumps({"kv_connector": "JServeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"peers": list(peers),
                                                     "timeout_s": timeout_s}})


@pytest.fixture(scope="module")
def producer():
    s = Served("--kv-transfer-config", _kv_config("kv_producer"), "--kv-cache-dtype", "int8",
               *FLAGS)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def consumer(peers, producer):
    gone = f"http://127.0.0.1:{_closed_port()}"
    urls = {k: f"{peers}/{k}" for k in ("cut", "error", "garbage", "slow")} | {"gone": gone}
    s = Served("--kv-transfer-config",
               _kv_config("kv_consumer", [*urls.values(), producer.url], timeout_s=1.5),
               "--kv-cache-dtype", "int8", *FLAGS)
    s.peers = urls
    yield s
    s.stop()


def test_two_processes_by_vllms_protocol_give_the_producers_tokens(producer, consumer):
    """A proxy's two requests as vLLM's disaggregation proxy sends them (its NIXL test
    proxy): the prompt to the producer with its ``kv_transfer_params`` (one token, not
    streamed), then the request to the consumer with the ``kv_transfer_params`` of the
    producer's response, copied as they came; int8 pages as stored."""
    prompt = LONG + " in pairs"
    want = _text(_complete(producer.url, prompt + "!"))  # another prompt: decoded there
    r = _complete(producer.url, prompt, max_tokens=1, stream=False, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    assert r.status_code == 200, r.text
    handoff = r.json()["kv_transfer_params"]
    assert handoff["remote_url"] == producer.url and handoff["do_remote_prefill"] is True
    got = _complete(consumer.url, prompt, kv_transfer_params=handoff)
    c = _counters(consumer.url, "jserve_kv_transfer_pages")
    assert c[("jserve_kv_transfer_pages_total", (("direction", "imported"),))] == 23
    assert _text(got) == _text(_complete(producer.url, prompt))
    assert _text(_complete(producer.url, prompt + "!")) == want
    # a prompt the producer does not hold (never run there, or evicted): nothing comes, it
    # is computed here, and the pull is counted as come short
    unseen = SHORT + " never prefilled there"
    got = _complete(consumer.url, unseen, kv_transfer_params={
        "do_remote_prefill": True, "remote_url": producer.url})
    assert _text(got) == _text(_complete(producer.url, unseen))
    assert _pages_used(producer.url) == _pages_used(consumer.url) == 0


def test_failed_pulls_are_counted_and_the_prompt_computed_here(consumer):
    want = _text(_complete(consumer.url, LONG))
    for kind, url in consumer.peers.items():
        r = _complete(consumer.url, LONG + kind,
                      kv_transfer_params={"do_remote_prefill": True, "remote_url": url})
        assert _text(r) == _text(_complete(consumer.url, LONG + kind)), kind
    assert _text(_complete(consumer.url, LONG)) == want
    c = _counters(consumer.url, "jserve_kv_transfer_failures")
    reasons = {dict(labels)["reason"]: v for (_, labels), v in c.items()}
    assert reasons == {"unreachable": 2.0, "refused": 1.0, "format": 1.0, "timeout": 1.0,
                       "evicted": 1.0}  # the test above's unseen prompt
    c = _counters(consumer.url, "jserve_kv_transfer_pages")
    assert c[("jserve_kv_transfer_pages_total", (("direction", "imported"),))] == 23  # only
    # the producer's (the test above)
    assert _pages_used(consumer.url) == 0


def test_pulls_only_from_peers(consumer):
    r = _complete(consumer.url, SHORT, kv_transfer_params={
        "do_remote_prefill": True, "remote_url": "http://169.254.169.254"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params.remote_url"
    r = _complete(consumer.url, SHORT, kv_transfer_params={"do_remote_prefill": True})
    assert r.status_code == 400 and "remote_url" in r.json()["error"]["message"]
    # a consumer exports nothing
    r = httpx.post(consumer.url + "/v1/kv/export", json={"token_ids": [1, 2, 3]}, timeout=10)
    assert r.status_code == 404
    r = _complete(consumer.url, SHORT, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "kv_transfer_params.do_remote_decode"
    r = _complete(consumer.url, SHORT, kv_transfer_params={"do_remote_decode": 1})
    assert r.status_code == 400 and "must be a bool" in r.json()["error"]["message"]
    r = _complete(consumer.url, SHORT, kv_transfer_params={"remote_blocks": [1]})
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]


def test_merge_metrics_labels_each_engine_and_sums_counters():
    a = ("# TYPE x_total counter\nx_total{k=\"1\"} 2.0\nx_created{k=\"1\"} 100.0\n"
         "# TYPE g gauge\ng 0.5\n")
    b = ("# TYPE x_total counter\nx_total{k=\"1\"} 3.0\nx_created{k=\"1\"} 200.0\n"
         "# TYPE g gauge\ng 0.25\n")
    samples = {}
    for fam in text_string_to_metric_families(merge_metrics([("e0", a), ("e1", b)])):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples == {
        ("x_total", (("engine", "e0"), ("k", "1"))): 2.0,
        ("x_total", (("engine", "e1"), ("k", "1"))): 3.0,
        ("x_total", (("k", "1"),)): 5.0,
        ("x_created", (("engine", "e0"), ("k", "1"))): 100.0,
        ("x_created", (("engine", "e1"), ("k", "1"))): 200.0,
        ("g", (("engine", "e0"),)): 0.5,
        ("g", (("engine", "e1"),)): 0.25,
    }


# -- a transformers-written checkpoint with its tokenizer, through the official client ------
def test_a_checkpoint_chat_through_the_openai_client_is_disaggregated_exactly():
    """A Llama checkpoint saved by transformers, with a BPE tokenizer and a chat template,
    behind ``-dp 2 --prefill-engines 1 --disaggregation always``: the openai client's chat
    (whole and streamed) gives the prefill engine's own greedy reply, and the pages moved."""
    import openai

    from hf_models import tiny_llama_dir

    model = str(tiny_llama_dir("llama2", with_tokenizer=True))
    front = Served("--model", model, "--data-parallel-size", "2", "--prefill-engines", "1",
                   "--disaggregation", "always", *FLAGS)
    try:
        name = httpx.get(front.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        messages = [{"role": "system", "content": "You count fruit."},
                    {"role": "user", "content": "How many apples are in the basket " * 4}]
        kw = dict(model=name, messages=messages, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
        prefill = openai.OpenAI(base_url=_engines(front)[0]["url"] + "/v1", api_key="x")
        want = prefill.chat.completions.create(**kw).choices[0].message.content
        client = openai.OpenAI(base_url=front.url + "/v1", api_key="x")
        got = client.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or ""
                           for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        assert got == streamed == want and want
        c = _counters(front.url, "jserve_kv_transfer_pages")
        assert c[("jserve_kv_transfer_pages_total", (("direction", "imported"),))] >= 2
        assert [_pages_used(e["url"]) for e in _engines(front)] == [0, 0]
    finally:
        front.stop(60)

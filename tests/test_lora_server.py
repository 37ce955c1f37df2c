"""LoRA adapters through the server (jserve/serving: the engine client's adapters,
``http_models``, gRPC's ``lora_name``, the metrics), as vLLM serves them.

A real ``jserve serve`` on the tiny Llama 3 checkpoint (float32) with ``--enable-lora
--lora-modules a=... b=... --max-loras 2 --enable-runtime-lora-updating``: through the official
``openai`` client the OpenAI ``model`` field picks the adapter, and greedy tokens equal
transformers + peft's for each adapter and the base model, concurrently (and over gRPC by
``lora_name``); ``/v1/models`` lists the adapters with their ``parent``; adapter "c" loaded at
run time serves peft's tokens beside a and b on two slots (an eviction), is unloaded, and a
second unload is 404; each bad adapter's load is a 400 naming what is wrong while a long
request on another adapter runs on, to the tokens it has alone; an unknown model is 404; the
metrics show the adapters (``vllm:lora_requests_info``, loads and evictions).

The edge's own rules (chat and Responses bodies, the race of an unload with a request, routes
absent without runtime updating, an adapter in use) run on a ``FakeEngine`` in process.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import httpx2 as httpx
import openai
import pytest

import lora_models as lm
from conftest import Served, gauges
from hf_models import tiny_llama_dir
from jserve import SamplingParams
from jserve.client import Client, bad_field
from jserve.lora import LoRAConfig
from jserve.serving.app import BackgroundServer, ServerConfig
from jserve.serving.engine_api import NOT_FOUND
from jserve.serving.fake_engine import TEXT, FakeEngine, adapter_offset

TOKEN = "lora-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
N = 8
LONG = 480  # tokens of the request that runs while bad adapters are refused
KEYS = (None, "a", "b", "c")
# What each bad adapter's 400 says (tests/lora_models.py writes them).
BAD_WORDS = {"unknown_module": "has no module", "shape_mismatch": "the base model needs",
             "rank_too_large": "rank 64 is over --max-lora-rank 16",
             "missing_file": "no adapter_model.safetensors"}


# -- a real server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base():
    return tiny_llama_dir(lm.BASE)


@pytest.fixture(scope="module")
def reference():
    """transformers + peft's greedy tokens per adapter key (None: the base model)."""
    return lm.reference_tokens(lm.PROMPTS, N, KEYS)


def _served(base, *flags: str) -> Served:
    a, b = (lm.peft_adapter_dir(lm.BASE, k) for k in "ab")
    s = Served("--model", str(base), "--enable-lora", "--lora-modules", f"a={a}", f"b={b}",
               "--max-loras", "2", "--enable-runtime-lora-updating", "--decode-burst", "1",
               "--api-key", TOKEN, *flags)
    s.base_name = base.name  # the served name: the directory's
    s.lines = [s.line]
    while not s.lines[-1].startswith("jserve: LoRA") and len(s.lines) < 4:
        s.lines.append(s.proc.stdout.readline())
    return s


@pytest.fixture(scope="module")
def served(base):
    s = _served(base)
    yield s
    s.close()


@pytest.fixture(scope="module")
def served_process(base):
    """The same server with its engine core in a process of its own."""
    s = _served(base, "--engine-process")
    yield s
    s.close()


BOTH = pytest.mark.parametrize("which", ["served", "served_process"])


def _tokens(logprobs_tokens) -> list[int]:
    """Token ids from a completion's logprobs (a model without a tokenizer writes ids)."""
    return [int(t) for t in logprobs_tokens]


async def _complete(client, model: str, prompt: list[int], n: int = N) -> list[int]:
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=n,
                                        temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True})
    assert r.model == model and r.choices[0].finish_reason == "length"
    return _tokens(r.choices[0].logprobs.tokens)


def _run_all(served, jobs: list[tuple[str, list[int]]]) -> list[list[int]]:
    """Every (model, prompt) of ``jobs`` at once through the openai client."""
    async def run():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=TOKEN,
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(_complete(client, m, p) for m, p in jobs))
    return asyncio.run(run())


def _model(served, key):
    return served.base_name if key is None else key


def _post(served, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(served.url + path, json=body, headers=headers, timeout=60)


def _lora_info(url: str) -> dict[str, str]:
    """The labels of ``vllm:lora_requests_info``'s one series (and its value, ``at``)."""
    series = [(k, v) for k, v in gauges(url, TOKEN).items()
              if k.startswith("vllm:lora_requests_info{")]
    assert len(series) == 1, series
    key, value = series[0]
    return {**json.loads(key[len("vllm:lora_requests_info"):]), "at": value}


def _models(served) -> list[dict]:
    return httpx.get(served.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]


@BOTH
def test_model_picks_the_adapter_equal_to_peft_concurrently_and_over_grpc(which, request,
                                                                          reference):
    served = request.getfixturevalue(which)
    jobs = [(k, i) for _ in range(2) for k in (None, "a", "b") for i in range(len(lm.PROMPTS))]
    got = _run_all(served, [(_model(served, k), lm.PROMPTS[i]) for k, i in jobs])
    assert got == [reference[k][i] for k, i in jobs]
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    with Client(served.target, auth_token=TOKEN) as c:
        assert c.model_info().max_loras == 2
        for k, i in ((None, 0), ("b", 1), ("a", 2)):
            out = c.generate(lm.PROMPTS[i], greedy, lora_name=k or "")
            assert out.token_ids == reference[k][i]
        with pytest.raises(grpc.RpcError) as e:
            c.generate(lm.PROMPTS[0], greedy, lora_name="zz")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and bad_field(e.value) == "lora_name"
        assert "no adapter 'zz' is loaded" in e.value.details()


def test_models_lists_the_adapters_and_an_unknown_model_is_404(served, base):
    a, b = (str(lm.peft_adapter_dir(lm.BASE, k)) for k in "ab")
    cards = _models(served)
    assert [(m["id"], m["root"], m["parent"]) for m in cards] == [
        (served.base_name, served.base_name, None), ("a", a, served.base_name),
        ("b", b, served.base_name)]
    assert all(m["object"] == "model" for m in cards)
    one = httpx.get(served.url + "/v1/models/b", headers=AUTH, timeout=30).json()
    assert (one["id"], one["root"], one["parent"]) == ("b", b, served.base_name)
    assert httpx.get(served.url + "/v1/models/zz", headers=AUTH, timeout=30).status_code == 404
    r = _post(served, "/v1/completions", {"model": "zz", "prompt": lm.PROMPTS[0],
                                          "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "model 'zz' does not exist" in r.json()["error"]["message"]
    with openai.OpenAI(base_url=served.url + "/v1", api_key=TOKEN, max_retries=0) as c:
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="zz", prompt=lm.PROMPTS[0], max_tokens=2)
    # The start-up says which adapters it serves (stdout), and so does the engine's log.
    assert served.lines[-1] == (f"jserve: LoRA adapters: a ({a}), b ({b}); --max-loras 2 on "
                                "the device, --max-lora-rank 16; runtime loading on "
                                "(/v1/load_lora_adapter)\n")
    log = os.pread(served.stderr.fileno(), 1 << 20, 0).decode()
    assert "LoRA: 2 adapter slot(s) of rank 16 on the device, 2 adapter(s) loaded (a, b)" in log


@BOTH
def test_an_adapter_loaded_at_run_time_serves_then_unloads(which, request, reference):
    served = request.getfixturevalue(which)
    c = str(lm.peft_adapter_dir(lm.BASE, "c"))
    body = {"lora_name": "c", "lora_path": c}
    assert _post(served, "/v1/load_lora_adapter", body, headers={}).status_code == 401
    r = _post(served, "/v1/load_lora_adapter", body)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' added successfully.")
    assert [m["id"] for m in _models(served)] == [served.base_name, "a", "b", "c"]
    before = gauges(served.url, TOKEN)
    # Three adapters at once on two slots: one is evicted for another while they run.
    jobs = [(k, i) for k in ("c", "a", "b", "c") for i in range(len(lm.PROMPTS))]
    got = _run_all(served, [(k, lm.PROMPTS[i]) for k, i in jobs])
    assert got == [reference[k][i] for k, i in jobs]
    after = gauges(served.url, TOKEN)
    assert after["jserve_lora_loads_total"] >= before["jserve_lora_loads_total"] + 1
    assert after["jserve_lora_evictions_total"] >= 1
    assert after["jserve_lora_adapters_running"] == after["jserve_lora_adapters_waiting"] == 0
    for again, words in ((body, "has already been loaded"),
                         ({"lora_name": served.base_name, "lora_path": c},
                          "is the base model's name"),
                         ({"lora_name": "d"}, "Both 'lora_name' and 'lora_path'")):
        r = _post(served, "/v1/load_lora_adapter", again)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = _post(served, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
    r = _post(served, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 404 and "'c' cannot be found" in r.json()["error"]["message"]
    assert _post(served, "/v1/completions", {"model": "c", "prompt": lm.PROMPTS[0],
                                             "max_tokens": 2}).status_code == 404
    assert [m["id"] for m in _models(served)] == [served.base_name, "a", "b"]


def _long(served, stream: bool = False) -> dict:
    return {"model": "a", "prompt": lm.PROMPTS[0], "max_tokens": LONG, "temperature": 0,
            "logprobs": 0, "ignore_eos": True, "stream": stream}


def test_bad_adapters_are_refused_while_a_long_request_runs_on(served, reference):
    alone = _tokens(_post(served, "/v1/completions", _long(served)).json()["choices"][0][
        "logprobs"]["tokens"])
    assert len(alone) == LONG and alone[:N] == reference["a"][0]
    tokens = []
    with httpx.stream("POST", served.url + "/v1/completions", json=_long(served, True),
                      headers=AUTH, timeout=120) as resp:
        assert resp.status_code == 200
        events = (line[len("data: "):] for line in resp.iter_lines()
                  if line.startswith("data: "))

        def read() -> bool:
            event = next(events)
            if event == "[DONE]":
                return False
            tokens.extend(_tokens(json.loads(event)["choices"][0]["logprobs"]["tokens"]))
            return True
        while not tokens:  # the request runs: it has its first token
            assert read()
        for name, path in lm.bad_adapters_dir(lm.BASE).items():
            r = _post(served, "/v1/load_lora_adapter", {"lora_name": f"bad-{name}",
                                                        "lora_path": str(path)})
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert err["param"] == "lora_path" and BAD_WORDS[name] in err["message"], (name, err)
        # ... and the request was still running once all four were refused
        info = _lora_info(served.url)
        assert info["running_lora_adapters"] == "a" and info["max_lora"] == "2"
        assert abs(info["at"] - time.time()) < 60
        while read():
            pass
    assert tokens == alone
    assert [m["id"] for m in _models(served)] == [served.base_name, "a", "b"]


# -- the edge on a fake engine -----------------------------------------------------------------
@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """A FakeEngine with adapter "x" (and runtime loading) behind the server, in process."""
    root = tmp_path_factory.mktemp("adapters")
    for name in ("x", "y"):
        (root / name).mkdir()
    engine = FakeEngine(lora=LoRAConfig(max_loras=2, modules=(("x", str(root / "x")),),
                                        runtime_updating=True))
    server = BackgroundServer(engine, ServerConfig(port=0, metrics_port=None, http_port=0,
                                                   auth_token=TOKEN))
    server.url, server.engine, server.root = server.http_url, engine, root
    yield server
    server.stop(grace=0)


def _scripted(prompt: list[int], adapter: str | None, n: int) -> str:
    start = sum(prompt) + adapter_offset(adapter)
    return "".join(TEXT[(start + i) % len(TEXT)] for i in range(n))


def test_fake_model_field_reaches_the_engine_on_every_endpoint(fake):
    prompt = [3, 4, 5]
    for model, adapter in (("default", None), ("x", "x")):
        r = httpx.post(fake.url + "/v1/completions", headers=AUTH, timeout=30, json={
            "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}).json()
        assert r["model"] == model and r["choices"][0]["text"] == _scripted(prompt, adapter, 6)
        assert fake.engine.received[-1].prepared.adapter == adapter
    chat = httpx.post(fake.url + "/v1/chat/completions", headers=AUTH, timeout=30, json={
        "model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == "x"
    assert fake.engine.received[-1].prepared.adapter == "x"
    resp = httpx.post(fake.url + "/v1/responses", headers=AUTH, timeout=30, json={
        "model": "x", "input": "hi", "max_output_tokens": 3})
    assert resp.status_code == 200 and resp.json()["model"] == "x"
    assert fake.engine.received[-1].prepared.adapter == "x"
    tok = httpx.post(fake.url + "/tokenize", headers=AUTH, timeout=30,
                     json={"model": "x", "prompt": "hi"})
    assert tok.status_code == 200 and tok.json()["tokens"] == [256, 104, 105]
    for path, body in (("/v1/completions", {"prompt": prompt, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/tokenize", {"prompt": "hi"})):
        r = httpx.post(fake.url + path, headers=AUTH, timeout=30, json={**body, "model": "zz"})
        assert r.status_code == 404 and "model 'zz' does not exist" in r.text, (path, r.text)


def test_fake_loads_unloads_and_refuses_an_adapter_in_use(fake):
    url = fake.url
    y = str(fake.root / "y")
    r = httpx.post(url + "/v1/load_lora_adapter", headers=AUTH, timeout=30,
                   json={"lora_name": "y", "lora_path": str(fake.root / "nope")})
    assert r.status_code == 400 and "no such directory" in r.json()["error"]["message"]
    for body, field in (({"lora_name": "y", "lora_path": y, "load_inplace": True},
                         "load_inplace"),
                        ({"lora_name": "y", "lora_path": y, "extra": 1}, "extra"),
                        ({"lora_name": 3, "lora_path": y}, "lora_name")):
        r = httpx.post(url + "/v1/load_lora_adapter", headers=AUTH, timeout=30, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(url + "/v1/load_lora_adapter", headers=AUTH, timeout=30,
                   json={"lora_name": "y", "lora_path": y})
    assert r.status_code == 200
    assert [m["id"] for m in httpx.get(url + "/v1/models", headers=AUTH).json()["data"]] == [
        "default", "x", "y"]
    # A request on y holds it: its unload is refused until the request ends.
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, timeout=30, json={
            "model": "y", "prompt": [1], "max_tokens": 400, "ignore_eos": True,
            "stream": True}) as resp:
        lines = resp.iter_lines()  # (held: a dropped iterator closes the response)
        next(lines)
        r = httpx.post(url + "/v1/unload_lora_adapter", headers=AUTH, timeout=30,
                       json={"lora_name": "y"})
        assert r.status_code == 400 and "in use by 1 request" in r.json()["error"]["message"]
        g = gauges(url, TOKEN)
        assert g['vllm:lora_requests_info{"max_lora": "2", "running_lora_adapters": "y", '
                 '"waiting_lora_adapters": ""}'] > 0
    deadline = time.monotonic() + 10
    while (r := httpx.post(url + "/v1/unload_lora_adapter", headers=AUTH, timeout=30,
                           json={"lora_name": "y"})).status_code == 400:
        assert time.monotonic() < deadline, r.text  # the abort lands at the next step
        time.sleep(0.01)
    assert r.status_code == 200
    r = httpx.post(url + "/v1/unload_lora_adapter", headers=AUTH, timeout=30,
                   json={"lora_name": "y", "lora_int_id": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id"


def test_an_unload_between_intake_and_admission_refuses_the_request(tmp_path):
    """Prepared (checked) on an intake thread, the adapter unloaded before the engine thread
    takes the request: its stream's only delta is NOT_FOUND, and nothing is queued."""
    fake = FakeEngine(lora=LoRAConfig(max_loras=1, modules=(("x", str(tmp_path)),)))

    async def main():
        fake.start()
        try:
            prepared = fake.prepare([1, 2], SamplingParams(max_tokens=4), "x")
            await fake.unload_adapter("x")
            sink = fake.submit("r", prepared, arrival_time=time.monotonic())
            delta = await asyncio.wait_for(sink.get(), 10)
            return delta, await fake.stats(), await fake.adapters()
        finally:
            fake.shutdown()
    delta, stats, adapters = asyncio.run(main())
    assert delta.error == (NOT_FOUND, "model 'x' does not exist: its LoRA adapter was "
                                      "unloaded")
    assert stats["engine_requests"] == 0 and adapters == {}


def test_without_runtime_updating_the_routes_are_absent_and_without_lora_so_is_model(tmp_path):
    for lora in (LoRAConfig(modules=(("x", str(tmp_path)),)), None):
        server = BackgroundServer(FakeEngine(lora=lora), ServerConfig(
            port=0, metrics_port=None, http_port=0))
        try:
            url = server.http_url
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                r = httpx.post(url + path, json={"lora_name": "x", "lora_path": str(tmp_path)},
                               timeout=30)
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = httpx.post(url + "/v1/completions", timeout=30, json={
                "model": "x", "prompt": [1], "max_tokens": 2})
            assert r.status_code == (200 if lora else 404), r.text
            ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
            assert ids == (["default", "x"] if lora else ["default"])
            metrics = httpx.get(url + "/metrics", timeout=30).text
            assert ("vllm:lora_requests_info" in metrics) is (lora is not None)
        finally:
            server.stop(grace=0)

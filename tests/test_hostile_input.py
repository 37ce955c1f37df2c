"""Strangers' traffic (issue 39): no request can kill, crash or tie up the server.

Against a real ``jserve serve`` (HTTP and gRPC): each class of input that once stopped the
engine or got a 500 now gets a 400 / INVALID_ARGUMENT naming its field, and the same process
then serves a greedy request with the tokens it gave before, every KV page free. Then
property-based fuzzing of every HTTP endpoint and every gRPC method, and fault injection: an
exception raised inside one request's part of the work (intake, the engine's per-request
stages, output processing, response formatting) ends that request alone with a 500 /
INTERNAL while the others finish with their reference tokens.

Each class of the report is refused at the edge, so those tests run ``jserve serve
--fake-engine`` (``served``: no model); the fuzzing, whose accepted values reach the engine,
and the fault injection, inside the engine's stages, run on the real one (``live_served``,
``inproc``).
"""
from __future__ import annotations

import json
import math
import threading

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import Served, wait_blocks_free, wait_idle
from jserve import fields
from jserve.client import Client
from jserve.proto import generate_pb2 as pb
from jserve.serving import responses_api
from jserve.serving.http_protocol import PARAMS

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HUGE = "1" + "0" * 400  # a valid JSON number, an int of 401 digits in Python
PROBE = {"model": "default", "prompt": "Hello, jserve", "max_tokens": 12, "temperature": 0,
         "ignore_eos": True}


def _served(*flags: str) -> Served:
    s = Served("--auth-token", TOKEN, *flags)
    s.probe = probe_text(s)  # what a greedy request gives before anything hostile
    return s


@pytest.fixture(scope="module")
def served():
    s = _served("--fake-engine")
    yield s
    s.close()


@pytest.fixture(scope="module")
def live_served():
    s = _served()
    yield s
    s.close()


def post(served, path: str, body, timeout: float = 60) -> httpx.Response:
    """``body`` as JSON, or as it is when already text (numbers JSON can carry but Python
    cannot write, e.g. a 400-digit literal in a float field)."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(served.url + path, content=content, timeout=timeout,
                      headers={**AUTH, "content-type": "application/json"})


def probe_text(served) -> str:
    r = post(served, "/v1/completions", PROBE)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_whole(served) -> None:
    """The server serves the probe as before and holds no KV page."""
    assert probe_text(served) == served.probe
    wait_blocks_free(served.url, TOKEN)


def refused(r: httpx.Response, field: str | None) -> str:
    """A 400 in OpenAI's error shape naming ``field``; its message."""
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "invalid_argument", err
    return err["message"]


def literal(body: dict, field: str, text: str) -> str:
    """``body`` as JSON with ``field``'s value written as the literal ``text``."""
    return json.dumps({**body, field: "@@"}).replace('"@@"', text)


# -- each class of the report ----------------------------------------------------------------
def test_numbers_are_checked_against_one_table_before_any_arithmetic():
    for field, value in (("ttft_slo", int(HUGE)), ("temperature", int(HUGE)),
                         ("top_p", math.nan), ("tpot_slo", math.inf), ("seed", 2**32),
                         ("n", True), ("priority", 2**31), ("max_tokens", 1.0)):
        with pytest.raises(ValueError, match=f"^{field} must be") as e:
            fields.number(field, value)
        assert len(str(e.value)) < 120  # a 400-digit value is not echoed whole
    assert fields.number("ttft_slo", 3) == 3.0 and type(fields.number("ttft_slo", 3)) is float
    assert fields.number("seed", 2**32 - 1) == 2**32 - 1
    nested = "[" * 64 + "]" * 64
    assert fields.depth(fields.loads(nested, "x")) == 64
    for deeper in ("[" * 65 + "]" * 65, "[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1"
                   + "}" * 5000):
        with pytest.raises(ValueError, match="x is nested more than 64 levels deep"):
            fields.loads(deeper, "x")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_huge_ttft_slo_gets_400_and_the_engine_keeps_serving(served, path):
    body = dict(PROBE) if path == "/v1/completions" else {
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    message = refused(post(served, path, literal(body, "ttft_slo", HUGE)), "ttft_slo")
    assert "ttft_slo must be > 0 and <= 1000000" in message and "401 digits" in message
    assert_whole(served)
    assert httpx.get(served.url + "/health", timeout=10).json() == {"status": "ok"}


FLOATS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
          "repetition_penalty", "ttft_slo", "tpot_slo")
INTS = ("max_tokens", "min_tokens", "top_k", "seed", "n", "priority", "logprobs")


@pytest.mark.parametrize("field", FLOATS + INTS)
def test_a_400_digit_number_in_any_numeric_field_gets_400_naming_it(served, field):
    for text in (HUGE, "-" + HUGE, "1e400", "NaN", "-Infinity"):
        assert refused(post(served, "/v1/completions", literal(PROBE, field, text)), field)
    if field in ("temperature", "top_p", "ttft_slo"):
        chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}
        refused(post(served, "/v1/chat/completions", literal(chat, field, HUGE)), field)
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True}
    refused(post(served, "/v1/chat/completions", literal(chat, "top_logprobs", HUGE)),
            "top_logprobs")


def test_deep_json_gets_400_in_the_body_and_in_every_nested_json(served):
    deep = "[" * 5000 + "]" * 5000
    r = post(served, "/v1/completions", literal(PROBE, "user", deep))
    assert "nested more than 64 levels" in refused(r, None)
    schema = '{"type": "object", "properties": ' * 3000 + "{}" + "}" * 3000
    so = literal({"model": "default", "prompt": "hi"}, "structured_outputs",
                 '{"json": ' + schema + "}")
    assert "nested more than 64" in refused(post(served, "/v1/completions", so), None)
    as_text = {**PROBE, "structured_outputs": {"json": schema}}
    assert "structured_outputs.json is nested" in refused(
        post(served, "/v1/completions", as_text), "structured_outputs")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    chat = {"model": "default", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert "nested" in refused(post(served, "/v1/chat/completions", chat),
                               "messages[1].tool_calls[0].function.arguments")
    assert_whole(served)


def test_a_lone_surrogate_key_gets_400_echoing_it(served):
    r = post(served, "/v1/completions", json.dumps({**PROBE, "\ud800": 1}))
    assert refused(r, "\ud800") == "\ud800 is not supported by jserve"
    assert r.headers["content-type"] == "application/json"
    r = post(served, "/v1/completions", json.dumps({**PROBE, "model": "m\udfff"}))
    assert r.status_code == 404 and "'m\\udfff'" in r.json()["error"]["message"]


def test_route_wait_checks_its_numbers(served):
    for text in (HUGE, "0", "1.5", "true", "NaN"):
        r = post(served, "/v1/route/wait", '{"prompt_tokens": ' + text + "}")
        assert r.status_code == 400 and "prompt_tokens must be" in r.json()["error"]["message"]
    r = post(served, "/v1/route/wait", '{"prompt_tokens": 5, "ttft_slo": ' + HUGE + "}")
    assert r.status_code == 400 and "ttft_slo must be" in r.json()["error"]["message"]
    r = post(served, "/v1/route/wait", "[" * 5000 + "]" * 5000)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    r = post(served, "/v1/route/wait", {"prompt": {"a": 1}})
    assert r.status_code == 400 and "prompt must be" in r.json()["error"]["message"]
    r = post(served, "/v1/route/wait", {"prompt_tokens": 40})
    assert r.status_code == 200 and r.json()["prompt_tokens"] == 40


def _call(served, request: pb.GenerateRequest) -> grpc.RpcError | None:
    """The gRPC call's error, None when it ended with a result."""
    with Client(served.target, auth_token=TOKEN) as c:
        try:
            c.generate(request, timeout=60)
        except grpc.RpcError as e:
            return e
    return None


def test_grpc_refuses_deep_schemas_and_unbounded_slos_naming_the_field(served):
    def req(**kw) -> pb.GenerateRequest:
        return pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_tokens=2),
                                  **kw)
    deep = req()
    deep.sampling_params.structured_output.json_schema = "[" * 5000 + "]" * 5000
    cases = [(deep, "structured_output.json_schema is nested more than 64"),
             (req(ttft_slo_seconds=math.inf), "ttft_slo_seconds must be"),
             (req(ttft_slo_seconds=1e300), "ttft_slo_seconds must be"),
             (req(tpot_slo_seconds=math.nan), "tpot_slo_seconds must be")]
    for request, words in cases:
        e = _call(served, request)
        assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
        assert words in e.details(), e.details()
    assert _call(served, req(ttft_slo_seconds=1e6)) is None
    assert_whole(served)


# -- fuzzing ---------------------------------------------------------------------------------
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(10**20, 10**500)
           | st.floats() | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
NUMBER = (st.integers(-3, 40) | st.floats(-1.0, 3.0) | st.integers(-10**500, 10**500)
          | st.floats() | JSON)


def _value(field: str):
    """Plausible values of ``field`` and anything at all."""
    if field in FLOATS + INTS + ("top_logprobs", "best_of"):
        return NUMBER
    return {
        "prompt": st.just("Hi") | st.lists(st.integers(-2, 330), max_size=4) | JSON,
        "messages": st.just([{"role": "user", "content": "hi"}])
        | st.lists(st.fixed_dictionaries({"role": st.text(max_size=9), "content": JSON}),
                   max_size=2) | JSON,
        "stop": st.lists(st.text(max_size=3), max_size=3) | JSON,
        "structured_outputs": st.fixed_dictionaries({}, optional={
            "json": JSON, "regex": st.text(max_size=8), "choice": JSON}) | JSON,
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(
            ["text", "json_object", "json_schema"])}, optional={"json_schema": JSON}) | JSON,
    }.get(field, JSON)


def _body(endpoint: str):
    must = {"model": st.just("default") | JSON,
            "max_tokens": st.integers(1, 6) | NUMBER.filter(lambda v: v is not None)}
    must["prompt" if endpoint == "completions" else "messages"] = _value(
        "prompt" if endpoint == "completions" else "messages")
    optional = {f: _value(f) for f in sorted(PARAMS[endpoint] - set(must) - {
        "max_completion_tokens"})}
    optional["\ud800"] = JSON
    return st.fixed_dictionaries(must, optional=optional)


def _responses_body():
    """Responses bodies: plausible input items (messages, calls, their outputs) or anything,
    and anything in every other field."""
    item = st.fixed_dictionaries({"type": st.sampled_from(
        ["message", "function_call", "function_call_output", "reasoning"]) | JSON}, optional={
        "role": st.sampled_from(["user", "assistant", "developer"]) | JSON,
        "content": st.just("hi") | JSON, "call_id": st.just("c") | JSON,
        "name": st.just("f") | JSON, "arguments": st.just("{}") | JSON, "output": JSON})
    must = {"model": st.just("default") | JSON, "input": st.just("hi") | st.lists(
        item, max_size=3) | JSON, "max_output_tokens": st.integers(1, 6) | NUMBER}
    optional = {f: NUMBER if f in FLOATS + INTS else JSON
                for f in sorted(responses_api.FIELDS - set(must))}
    optional["tools"] = st.lists(st.fixed_dictionaries(
        {"type": st.just("function") | JSON, "name": st.just("f") | JSON},
        optional={"parameters": JSON, "strict": JSON}), max_size=2) | JSON
    optional["text"] = st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | JSON},
        optional={"schema": JSON, "name": JSON})}) | JSON
    optional["previous_response_id"] = st.just("resp_x") | JSON
    return st.fixed_dictionaries(must, optional=optional)


def embeddings_body():
    """Embedding bodies: plausible inputs (texts, ids, lists of them) or anything."""
    return st.fixed_dictionaries(
        {"model": st.just("default") | JSON,
         "input": st.just("hi") | st.lists(st.text(max_size=6), max_size=3)
         | st.lists(st.integers(-2, 330), max_size=4) | JSON},
        optional={"encoding_format": st.sampled_from(["float", "base64"]) | JSON,
                  "dimensions": NUMBER, "user": JSON, "priority": NUMBER,
                  "ttft_slo": NUMBER, "\ud800": JSON})


POSTS = {"/v1/completions": _body("completions"), "/v1/chat/completions": _body("chat"),
         "/v1/responses": _responses_body(), "/v1/embeddings": embeddings_body(),
         "/v1/score": st.fixed_dictionaries({"model": st.just("default") | JSON}, optional={
             "text_1": st.just("a") | JSON, "text_2": st.lists(st.text(max_size=4),
                                                               max_size=3) | JSON}),
         "/v1/rerank": st.fixed_dictionaries({"model": st.just("default") | JSON}, optional={
             "query": st.just("a") | JSON, "documents": st.lists(st.text(max_size=4),
                                                                 max_size=3) | JSON,
             "top_n": NUMBER, "return_documents": JSON}),
         "/v1/route/wait": st.fixed_dictionaries({}, optional={
             "prompt": _value("prompt"), "prompt_tokens": NUMBER, "ttft_slo": NUMBER}) | JSON}
GETS = ("/v1/models", "/health", "/metrics", "/get_load", "/v1/loads", "/get_model_info",
        "/model_info", "/get_server_info", "/server_info", "/health_generate",
        "/v1/route/load", "/v1/responses/resp_x")
DEPTH = st.integers(1, 200)


def _check_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], err
        assert r.status_code != 400 or err["param"] is not None or " " in err["message"], err


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(POSTS) + list(GETS)), data=st.data(), stream=st.booleans(),
       wrap=DEPTH)
def test_fuzzed_http_bodies_never_get_a_5xx(live_served, path, data, stream, wrap):
    """Arbitrary JSON values in every field of every endpoint (and the GET endpoints posted
    to, and bodies nested up to 200 deep): a 2xx, or a 4xx that says why; never a 5xx."""
    served = live_served
    if path in GETS:
        r = httpx.get(served.url + path, headers=AUTH, timeout=60)
        _check_answer(r)
        body = data.draw(JSON)
    else:
        body = data.draw(POSTS[path])
        if isinstance(body, dict) and "stream" not in body and path != "/v1/route/wait":
            body["stream"] = stream
        if data.draw(st.booleans()) and isinstance(body, dict):
            body = {**body, "user": json.loads("[" * wrap + "]" * wrap)}
    r = post(served, path, json.dumps(body))
    _check_answer(r)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["Generate", "GetModelInfo", "Check"]), data=st.data())
def test_fuzzed_grpc_calls_never_get_internal(live_served, method, data):
    """Arbitrary values in every field of every gRPC method (strings, ints to the wire's
    bounds, any double, deep JSON schemas): OK or a client-side status, never INTERNAL."""
    served = live_served
    metadata = [("authorization", f"Bearer {TOKEN}")]
    with grpc.insecure_channel(served.target) as ch:
        try:
            if method == "Check":
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
                    service=data.draw(st.text(max_size=20))), timeout=30)
            elif method == "GetModelInfo":
                ch.unary_unary("/jserve.v1.Generation/GetModelInfo",
                               request_serializer=lambda b: b,
                               response_deserializer=pb.ModelInfo.FromString)(
                    data.draw(st.binary(max_size=16)), timeout=30, metadata=metadata)
            else:
                error = _call(served, data.draw(_grpc_requests()))
                if error is not None:
                    raise error
        except grpc.RpcError as e:
            if method == "Check":  # the health protocol's answer for an unknown service
                assert e.code() == grpc.StatusCode.NOT_FOUND, e
            else:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details(), e


DOUBLE = st.floats() | st.floats(-2.0, 2.0)
INT64 = st.integers(-2**63, 2**63 - 1) | st.integers(-3, 40)


@st.composite
def _grpc_requests(draw) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=draw(st.integers(1, 4) | INT64))
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if draw(st.booleans()):
            setattr(sp, name, draw(DOUBLE))
    for name in ("min_tokens", "top_k", "seed", "logprobs"):
        if draw(st.booleans()):
            setattr(sp, name, draw(INT64))
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["json_schema", "regex", "grammar", "choice"]))
        if kind == "json_schema":
            depth = draw(st.integers(0, 300))
            sp.structured_output.json_schema = draw(st.just("[" * depth + "]" * depth)
                                                    | st.text(max_size=20)
                                                    | JSON.map(json.dumps))
        elif kind == "choice":
            sp.structured_output.choice.choices.extend(draw(st.lists(st.text(max_size=5),
                                                                     max_size=3)))
        else:
            setattr(sp.structured_output, kind, draw(st.text(max_size=12)))
    r = pb.GenerateRequest(request_id=draw(st.text(max_size=8)), sampling_params=sp,
                           priority=draw(st.integers(-2**31, 2**31 - 1)))
    if draw(st.booleans()):
        r.text = draw(st.text(min_size=0, max_size=10))
    else:
        r.token_ids.ids.extend(draw(st.lists(INT64, max_size=4)))
    for name in ("ttft_slo_seconds", "tpot_slo_seconds"):
        if draw(st.booleans()):
            setattr(r, name, draw(DOUBLE))
    return r


@pytest.mark.slow
def test_the_server_is_whole_after_the_fuzzing(live_served):
    assert_whole(live_served)


# -- fault injection ---------------------------------------------------------------------------
VICTIM = 13  # max_tokens of the requests a fault hits (the healthy one asks for 20)
HEALTHY = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0,
           "ignore_eos": True}


def _victim(params) -> bool:
    return params.max_tokens == VICTIM


def _stages():
    """(stage, (object or "engine", attribute), which request raises, which calls it hits):
    one stage of per-request work each, from intake to the response's formatting."""
    from jserve.engine import engine as engine_module
    from jserve.engine.requests.output import OutputProcessor
    from jserve.sampling.structured import Constraint
    from jserve.serving.engine_loop import EngineLoop
    from jserve.serving.http_responses import Formatter
    both = {"victim", "streamed"}
    return [
        ("request parsing", ("engine", "prepare"), lambda prompt, params: _victim(params), both),
        ("engine intake", ("engine", "enqueue"), lambda p, *a, **kw: _victim(p.params), both),
        ("sampler row", (engine_module, "sampler_row"),
         lambda r, *a: _victim(r.payload.params), both),
        ("grammar mask", (Constraint, "mask"), lambda self: True, both),
        ("grammar advance", (Constraint, "advance"), lambda self, tok: True, both),
        ("output processing", (OutputProcessor, "add_token"),
         lambda self, r, *a: _victim(r.payload.params), both),
        ("stream delta", (EngineLoop, "_delta"),
         lambda self, out, lv, o, now: lv.text.hold == 3, both),
        ("response formatting", (Formatter, "full"),
         lambda self, choices, *a: _victim(self.parsed.params), {"victim"}),
        ("stream formatting", (Formatter, "events"),
         lambda self, c, *a: _victim(self.parsed.params), {"streamed"}),
    ]


@pytest.fixture(scope="module")
def inproc():
    from jserve.serving.app import BackgroundServer, ServerConfig
    from llm_helpers import small_llm
    llm = small_llm()
    server = BackgroundServer(llm.engine, ServerConfig(host="127.0.0.1", port=0, http_port=0,
                                                       metrics_port=None))
    yield llm, server
    server.stop(grace=0)


def _answers(url: str, victim: dict) -> dict[str, object]:
    """The healthy request, the victim and the victim streamed, sent at once: each one's
    choices (streamed: its text) or ("error", status, message)."""
    results: dict[str, object] = {}

    def send(name: str, body: dict) -> None:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        if r.status_code != 200:
            results[name] = ("error", r.status_code, r.json()["error"]["message"])
            return
        if not body.get("stream"):
            results[name] = r.json()["choices"]
            return
        events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        if "error" in chunks[-1]:  # the error came after the stream started
            results[name] = ("error", 200, chunks[-1]["error"]["message"])
        else:
            results[name] = "".join(c["choices"][0]["text"] for c in chunks)
    threads = [threading.Thread(target=send, args=a) for a in (
        ("healthy", HEALTHY), ("victim", victim), ("streamed", {**victim, "stream": True}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.slow
def test_a_fault_in_one_requests_work_ends_it_alone(inproc, monkeypatch):
    """Each stage raises a different exception for the victim (sent plain and streamed,
    beside a healthy request): the victim gets a 500 (or, streamed, an error event) saying
    what failed, the healthy request its reference tokens, every block is free after, and the
    same engine serves on."""
    llm, server = inproc
    url = server.http_url
    exceptions = [RuntimeError, KeyError, OverflowError, RecursionError, ValueError,
                  AttributeError, TypeError, IndexError, UnicodeDecodeError]
    references = {}
    for k, (stage, (where, attr), pick, hits) in enumerate(_stages()):
        exc = exceptions[k % len(exceptions)]
        if where == "engine":  # a ValueError there is the client's by contract
            where, exc = llm.engine, RuntimeError if issubclass(exc, ValueError) else exc
        victim = {"model": "default", "prompt": "Hi", "max_tokens": VICTIM, "temperature": 0,
                  "ignore_eos": True, "stop": ["wxyz"]}  # holdback 3: stream delta's mark
        if stage.startswith("grammar"):
            victim["structured_outputs"] = {"regex": "[a-z]{20}"}
        key = json.dumps(victim)
        if key not in references:
            references[key] = _answers(url, victim)
        want = references[key]
        real = getattr(where, attr)

        def fake(*a, _real=real, _pick=pick, _exc=exc, **kw):
            if _pick(*a, **kw):
                raise (_exc("utf-8", b"", 0, 1, "injected") if _exc is UnicodeDecodeError
                       else _exc("injected"))
            return _real(*a, **kw)
        with monkeypatch.context() as m:
            m.setattr(where, attr, fake)
            got = _answers(url, victim)
        for name in ("healthy", "victim", "streamed"):
            if name in hits:
                assert got[name][0] == "error" and got[name][1] in (200, 500), (stage, got)
                assert "injected" in got[name][2], (stage, exc, got[name])
            else:
                assert got[name] == want[name], (stage, name, got[name], want[name])
        # Every page free once the engine is idle (a failed request's page comes back when
        # the step it was in, still on the device under async scheduling, is read).
        wait_idle(server, timeout=30)
    assert _answers(url, victim) == references[key]  # the same engine serves on

"""vLLM's surface of the OpenAI server, on a ``FakeEngine`` in process (the tokenizer matters
here, not the model): ``/tokenize``, ``/detokenize``, ``/version`` and ``GET /v1/models/{id}``;
the chat template's fields (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``) reaching the prompt ids; vLLM's older ``guided_*`` fields as
structured output; vLLM's latency histograms agreeing with jserve's own. The live engine's
round trip is in ``test_openai_api.py``."""
from __future__ import annotations

import json
import time

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import jserve
from jserve.serving.app import BackgroundServer, ServerConfig
from jserve.serving.fake_engine import FakeEngine
from jserve.tokenizer import ByteTokenizer, HFTokenizer, simple_chat_prompt

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fake():
    """The byte tokenizer's fake, served as ``org/tiny`` (and ``default``) with a token."""
    server = BackgroundServer(FakeEngine(), ServerConfig(
        port=0, metrics_port=None, http_port=0, auth_token=TOKEN,
        served_model_names=("org/tiny", "default")))
    server.url, server.engine = server.http_url, server.server.engine
    yield server
    server.stop(grace=0)


def _post(url: str, path: str, body, headers=AUTH) -> httpx.Response:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(url + path, headers=headers, timeout=60, **kw)


def _bad(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param is not None:
        assert param in err["message"], err
    return err


# -- /tokenize, /detokenize, /version, /v1/models/{id} ---------------------------------------
def test_tokenize_and_detokenize_as_vllm(fake):
    url, tok = fake.url, ByteTokenizer()
    r = _post(url, "/tokenize", {"prompt": "Hello"})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": [256, *b"Hello"], "count": 6, "max_model_len": 512,
                        "token_strs": None}
    bare = _post(url, "/tokenize", {"model": "org/tiny", "prompt": "Hello",
                                    "add_special_tokens": False}).json()
    assert bare["tokens"] == list(b"Hello") and bare["count"] == 5
    assert _post(url, "/detokenize", {"tokens": r.json()["tokens"]}).json() == {
        "prompt": "<bos>Hello"}
    assert _post(url, "/detokenize", {"model": "default", "tokens": bare["tokens"]}).json() == {
        "prompt": "Hello"}
    assert _post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    # A chat: the chat endpoint's prompt ids, with or without the generation prompt.
    chat = _post(url, "/tokenize", {"messages": MSGS}).json()
    assert chat["tokens"] == tok.encode(simple_chat_prompt(MSGS))
    plain = _post(url, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()
    assert plain["tokens"] == tok.encode(simple_chat_prompt(MSGS, add_generation_prompt=False))
    assert chat["tokens"][:len(plain["tokens"])] == plain["tokens"]
    assert chat["count"] == plain["count"] + len("<|assistant|>\n")
    no_bos = _post(url, "/tokenize", {"messages": MSGS, "add_special_tokens": False}).json()
    assert no_bos["tokens"] == chat["tokens"][1:]
    r = _post(url, "/v1/chat/completions", {"model": "default", "messages": MSGS,
                                            "max_tokens": 2, "add_generation_prompt": False})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == plain["count"]
    assert fake.engine.received[-1].prepared.prompt_ids == plain["tokens"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MSGS}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": MSGS, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", [1], 400, None),
    ("/tokenize", b"{not json", 400, None),
    ("/tokenize", {"prompt": "x", "model": "llama"}, 404, None),
    ("/detokenize", {"tokens": [320]}, 400, "tokens"),  # the fake's vocabulary: 320
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt"),
    ("/detokenize", {"tokens": [1], "model": "llama"}, 404, None),
])
def test_tokenize_refusals_name_the_field(fake, path, body, status, param):
    err = _bad(_post(fake.url, path, body), status, param)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_version_models_by_id_and_the_token(fake):
    url = fake.url
    assert httpx.get(url + "/version", headers=AUTH, timeout=30).json() == {
        "version": jserve.__version__}
    listed = httpx.get(url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    for name in ("org/tiny", "default"):  # any served name, a slash in it too
        r = httpx.get(f"{url}/v1/models/{name}", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json() == listed and listed["id"] == "org/tiny"
    _bad(httpx.get(url + "/v1/models/llama", headers=AUTH, timeout=30), 404, None)
    _bad(httpx.get(url + "/v1/models/org", headers=AUTH, timeout=30), 404, None)
    with openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0) as c:
        assert c.models.retrieve("org/tiny").id == "org/tiny"
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("llama")
    before = _outcome(url, "unauthenticated")
    for method, path in (("GET", "/version"), ("GET", "/v1/models/org/tiny"),
                         ("POST", "/tokenize"), ("POST", "/detokenize")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, url + path, headers=headers, timeout=30,
                              json={"prompt": "x", "tokens": [1]})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert _outcome(url, "unauthenticated") == before + 8
    assert httpx.post(url + "/version", headers=AUTH, timeout=30).status_code == 405
    assert httpx.get(url + "/tokenize", headers=AUTH, timeout=30).status_code == 405


def _outcome(url: str, outcome: str) -> float:
    return _metrics(url, AUTH)[("jserve_requests_total", (("outcome", outcome),))]


# -- the chat template's fields ---------------------------------------------------------------
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}"
            "{{ eos_token }}{% endfor %}{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% if strict %}{{ raise_exception('strict mode refuses this chat') }}{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A fake with an HF tokenizer whose chat template reads a variable of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Hello there, how are you?", "The reply continues here."],
                            trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                special_tokens=["<unk>", "<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    server = BackgroundServer(FakeEngine.for_model(str(path)), ServerConfig(
        port=0, metrics_port=None, http_port=0))
    server.url, server.engine, server.tok = server.http_url, server.server.engine, \
        HFTokenizer(path)
    yield server
    server.stop(grace=0)


def test_chat_template_fields_reach_the_prompt(templated):
    url, tok, engine = templated.url, templated.tok, templated.engine
    user = [{"role": "user", "content": "Hello there"}]
    reply = user + [{"role": "assistant", "content": "The reply "}]  # the template trims it
    cases = [  # (extra body fields, messages, the prompt text the template must give)
        ({}, user, "<s><|user|>Hello there</s><|assistant|>"),
        ({"chat_template_kwargs": {"greeting": "how are you"}}, user,
         "<s><|user|>Hello there</s>[how are you]<|assistant|>"),
        ({"chat_template_kwargs": {"bos_token": ""}}, user,  # over a special token's name
         "<|user|>Hello there</s><|assistant|>"),
        ({"add_generation_prompt": False}, user, "<s><|user|>Hello there</s>"),
        ({"add_generation_prompt": False, "chat_template_kwargs": {"greeting": "x"}}, user,
         "<s><|user|>Hello there</s>[x]"),
        # The reply continues the assistant's message: no end of turn after it.
        ({"continue_final_message": True}, reply,
         "<s><|user|>Hello there</s><|assistant|>The reply"),
        ({"continue_final_message": True, "add_generation_prompt": False}, reply,
         "<s><|user|>Hello there</s><|assistant|>The reply"),
    ]
    for extra, msgs, text in cases:
        want = tok.encode(text, add_special_tokens=False)
        got = _ok(url, "/tokenize", {"messages": msgs, **extra})
        assert got["tokens"] == want, (extra, tok.decode(got["tokens"], False), text)
        r = _ok(url, "/v1/chat/completions", {
            "model": "default", "messages": msgs, "max_tokens": 2, **extra})
        assert r["usage"]["prompt_tokens"] == len(want)
        assert engine.received[-1].prepared.prompt_ids == want, extra
    # Without a template variable the kwargs change nothing but what the template reads.
    assert _ok(url, "/tokenize", {"messages": user, "chat_template_kwargs": {
        "unused": [1, {"a": None}]}})["tokens"] == tok.encode(cases[0][2], False)


def _ok(url: str, path: str, body: dict) -> dict:
    r = _post(url, path, body, headers={})
    assert r.status_code == 200, (body, r.text)
    return r.json()


@pytest.mark.parametrize("extra, messages, param, words", [
    ({"continue_final_message": True}, None, "continue_final_message", "assistant"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "reply",
     "continue_final_message", "add_generation_prompt"),
    ({"continue_final_message": "yes"}, "reply", "continue_final_message", "a bool"),
    ({"add_generation_prompt": 0}, None, "add_generation_prompt", "a bool"),
    ({"continue_final_message": True}, "empty", "continue_final_message", "with content"),
    ({"chat_template_kwargs": ["greeting"]}, None, "chat_template_kwargs", "an object"),
    ({"chat_template_kwargs": {"messages": []}}, None, "chat_template_kwargs", "'messages'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, None,
     "chat_template_kwargs", "own field"),
    ({"chat_template_kwargs": {"strict": True}}, None, "messages", "strict mode refuses"),
    ({"chat_template_kwargs": {"self": 1}}, None, "messages", "chat template failed"),
    ({"chat_template": "{{ messages }}"}, None, "chat_template", "not supported"),
])
def test_chat_template_fields_are_refused_with_400_naming_them(templated, extra, messages,
                                                               param, words):
    msgs = {None: [{"role": "user", "content": "Hello"}],
            "reply": [{"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": "The"}],
            "empty": [{"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": ""}]}[messages]
    for path, body in (("/v1/chat/completions", {"model": "default", "max_tokens": 2}),
                       ("/tokenize", {})):
        err = _bad(_post(templated.url, path, {**body, "messages": msgs, **extra}, headers={}),
                   400, param)
        assert words in err["message"], (path, err)


def test_continue_final_message_on_the_built_in_format(fake):
    """The format of tokenizers without a template: the reply continues the last line."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    ids = _post(fake.url, "/tokenize", {"messages": msgs,
                                        "continue_final_message": True}).json()["tokens"]
    assert ids == ByteTokenizer().encode("<|user|>\nhi\n<|assistant|>\nHel")


# -- guided_* -------------------------------------------------------------------------------
def test_guided_fields_are_vllms_older_structured_outputs(fake):
    url, engine = fake.url, fake.engine
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for field, value, kind, want in (
            ("guided_json", schema, "json", schema),
            ("guided_json", json.dumps(schema), "json", schema),
            ("guided_regex", "[ab]+", "regex", "[ab]+"),
            ("guided_choice", ["yes", "no"], "choice", ("yes", "no")),
            ("guided_grammar", 'start: "x" | "y"', "grammar", 'start: "x" | "y"')):
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": MSGS})):
            r = _post(url, path, {"model": "default", "max_tokens": 3, field: value, **body})
            assert r.status_code == 200, (field, r.text)
            so = engine.received[-1].prepared.params.structured_output
            assert so.kind == kind and getattr(so, kind) == want, (field, so)
    refusals = [  # (body fields, the field the 400 names, words in its message)
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex",
         "not both"),
        ({"guided_json": schema, "response_format": {"type": "json_object"}}, "guided_json",
         "not both"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one of"),
        ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        ({"guided_regex": "("}, "guided_regex", "not a valid constraint"),  # at compile
        ({"guided_grammar": "start: nothing_defined"}, "guided_grammar", "not a valid"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
    ]
    for extra, param, words in refusals:
        err = _bad(_post(url, "/v1/completions", {"model": "default", "prompt": "hi",
                                                  "max_tokens": 3, **extra}), 400, param)
        assert words in err["message"] and "structured_output " not in err["message"], err


# -- vLLM's latency histograms ---------------------------------------------------------------
VLLM_FROM_JSERVE = {
    "vllm:time_to_first_token_seconds": "jserve_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "jserve_time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds": "jserve_time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds":
        "jserve_request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds": "jserve_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "jserve_request_queue_time_seconds",
    "vllm:request_prefill_time_seconds": "jserve_request_prefill_time_seconds",
    "vllm:request_decode_time_seconds": "jserve_request_decode_time_seconds",
    "vllm:request_inference_time_seconds": "jserve_request_inference_time_seconds",
    "vllm:request_prompt_tokens": "jserve_request_prompt_tokens",
    "vllm:request_generation_tokens": "jserve_request_generation_tokens",
}


def _metrics(url: str, headers=None) -> dict:
    """/metrics as {(sample name, labels without model_name): value}, and the model_name
    labels seen under ("model_name", sample name)."""
    out: dict = {}
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
            out.setdefault(("model_name", s.name), set()).add(s.labels.get("model_name"))
    return out


def _histogram(m: dict, name: str) -> dict:
    return {"count": m[(name + "_count", ())], "sum": m[(name + "_sum", ())],
            "buckets": {dict(k[1])["le"]: v for k, v in m.items()
                        if k[0] == name + "_bucket"}}


def test_vllm_latency_histograms_agree_with_jserves_own():
    step_s = 0.002
    server = BackgroundServer(FakeEngine(step_s=step_s), ServerConfig(
        port=0, metrics_port=None, http_port=0, served_model_names=("org/tiny",)))
    url = server.http_url
    try:
        def complete(body: dict) -> dict:
            r = _post(url, "/v1/completions", {"model": "org/tiny", "temperature": 0,
                                               "ignore_eos": True, **body}, headers={})
            assert r.status_code == 200, r.text
            return r.json()
        # Finished: 1 token (length); 2 choices of 6; a chat of 4; 1 token (a stop token:
        # the fake's first token for prompt [0] is TEXT[0], 'T').
        complete({"prompt": [5, 6, 7], "max_tokens": 1})
        complete({"prompt": [5, 6, 7], "max_tokens": 6, "n": 2})
        chat = _post(url, "/v1/chat/completions", {"model": "org/tiny", "messages": MSGS,
                                                   "max_tokens": 4, "ignore_eos": True},
                     headers={}).json()
        assert complete({"prompt": [0], "max_tokens": 9, "ignore_eos": False,
                         "stop_token_ids": [ord("T")]})["choices"][0]["finish_reason"] == "stop"
        # ... and one cancelled after its first token.
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "model": "org/tiny", "prompt": [9], "max_tokens": 500, "ignore_eos": True,
                "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.monotonic() + 30
        while (m := _metrics(url))[("jserve_requests_total", (("outcome", "cancelled"),))] < 1 \
                or m[("jserve_num_requests_running", ())] > 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for vllm, own in VLLM_FROM_JSERVE.items():
            assert _histogram(m, vllm) == _histogram(m, own), vllm
            assert m[("model_name", vllm + "_count")] == {"org/tiny"}
        count = {name: _histogram(m, name)["count"] for name in VLLM_FROM_JSERVE}
        finished = 5
        assert count["vllm:time_to_first_token_seconds"] == finished + 1  # + the cancelled
        for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                     "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
                     "vllm:request_generation_tokens"):
            assert count[name] == finished, name
        assert count["vllm:request_time_per_output_token_seconds"] == 3  # 2 tokens or more
        # One token a step: each step with tokens is one TTFT or one inter-token gap.
        assert count["vllm:inter_token_latency_seconds"] + finished + 1 == \
            m[("jserve_generation_tokens_total", ())]
        total = {name: _histogram(m, name)["sum"] for name in VLLM_FROM_JSERVE}
        assert total["vllm:request_generation_tokens"] == 1 + 12 + 4 + 1
        assert total["vllm:request_prompt_tokens"] == 3 + 2 * 3 + chat["usage"][
            "prompt_tokens"] + 1
        assert total["vllm:request_inference_time_seconds"] == pytest.approx(
            total["vllm:request_prefill_time_seconds"]
            + total["vllm:request_decode_time_seconds"])
        # Decoding 5 + 5 + 3 gaps took at least a step each.
        assert total["vllm:request_decode_time_seconds"] >= 13 * step_s * 0.9
        assert total["vllm:e2e_request_latency_seconds"] >= \
            total["vllm:request_queue_time_seconds"] \
            + total["vllm:request_inference_time_seconds"] - 1e-6
        outcomes = {o: m[("jserve_requests_total", (("outcome", o),))]
                    for o in ("stop", "length", "cancelled", "deadline_exceeded", "internal")}
        assert (outcomes["stop"], outcomes["length"], outcomes["cancelled"]) == (1, 4, 1)
        success = {r: m[("vllm:request_success_total", (("finished_reason", r),))]
                   for r in ("stop", "length", "abort", "error")}
        assert success == {"stop": 1, "length": 4, "abort": 1, "error": 0}
    finally:
        server.stop(grace=0)

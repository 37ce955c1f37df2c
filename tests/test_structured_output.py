"""Structured output (issue 27): on the random-weight default model every structure comes
from the constraint, so each sampled output is checked with an independent validator:
``jsonschema`` for JSON, ``re.fullmatch`` for regexes, Python's own parser for the
arithmetic grammar."""
from __future__ import annotations

import ast
import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest

from jserve.sampling.params import SamplingParams
from jserve.sampling.structured import GrammarCompiler, StructuredOutput
from jserve.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["a", "b", "c"]}}}}
REGEX = r"[0-9]{3}-[a-z]{2,4}(\.[A-Z])?"
CHOICES = ("red", "green", "blue", "dark blue")
# Sums and products of small numbers with parentheses, nested at most 2 deep.
GRAMMAR = r"""
start: expr
expr: term (("+" | "-") term){0,3}
term: atom ("*" atom){0,2}
atom: NUMBER | "(" inner ")"
inner: NUMBER (("+" | "*") NUMBER){0,2}
NUMBER: /[1-9][0-9]?/
"""


def _arithmetic(text: str) -> bool:
    """Python's parser accepts it as an expression of numbers, + - * and parentheses."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    ok = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return all(isinstance(n, ok) for n in ast.walk(tree)) and " " not in text


def test_a_constraint_names_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutput(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_output.choice must be a non-empty list"):
        StructuredOutput(choice=[])
    with pytest.raises(ValueError, match="structured_output.json must be"):
        StructuredOutput(json="{}")
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutput"):
        SamplingParams(structured_output={"regex": "a"})
    assert StructuredOutput(choice=["x", "y"]).choice == ("x", "y")


def test_bad_grammars_are_refused_naming_the_field_and_a_cache_hit_compiles_nothing():
    compiler = GrammarCompiler(ByteTokenizer(), 320, (257,))
    for so, field in ((StructuredOutput(regex="a[bc"), "regex"),
                      (StructuredOutput(grammar="start: undefined_rule"), "grammar"),
                      (StructuredOutput(json={"type": "frobnicate"}), "json")):
        with pytest.raises(ValueError, match=rf"structured_output.{field} is not a valid"):
            compiler.compile(so)
    assert compiler.compiles == 0
    a = compiler.compile(StructuredOutput(json=SCHEMA))
    b = compiler.compile(StructuredOutput(json=dict(SCHEMA)))  # equal schema: the same key
    assert (compiler.compiles, compiler.hits) == (1, 1)
    for t in b'{"':  # the copies move on their own
        assert a.advance(t)
    assert not a.done and b.mask().tolist() != a.mask().tolist()


def test_the_mask_allows_exactly_what_the_grammar_does():
    compiler = GrammarCompiler(ByteTokenizer(), 320, (257,))
    c = compiler.compile(StructuredOutput(choice=["no", "nay", "yes"]))

    def allowed():
        m = c.mask()
        return [t for t in range(320) if (int(m[t // 32]) >> (t % 32)) & 1]
    assert allowed() == [ord("n"), ord("y")]
    assert c.advance(ord("n")) and allowed() == [ord("a"), ord("o")]
    assert c.advance(ord("o")) and c.done and allowed() == [257]  # only EOS: complete


# -- \d, \w, \s are ASCII (issue 41: [A-Z]{3}-\d{4} gave 'SEG-6੬𖄷߉') ----------------------
DIGITS = set(b"0123456789")
WORD = DIGITS | set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
SPACE = set(b" \t\n\r\f\v")


def _allowed(c) -> set[int]:
    m = c.mask()
    return {t for t in range(320) if (int(m[t // 32]) >> (t % 32)) & 1}


def _accepts(compiler, so: StructuredOutput, text: str) -> bool:
    """The byte model's constraint takes ``text`` byte by byte and then allows EOS."""
    c = compiler.compile(so)
    for b in text.encode():
        if b not in _allowed(c) or not c.advance(b):
            return False
    return 257 in _allowed(c)


def test_d_w_s_are_the_ascii_classes_in_regexes_and_schema_patterns():
    """As in ECMAScript (JSON Schema's pattern dialect) and vLLM's engines: the first mask
    of ``\\d`` is the ten digit bytes, not also the lead bytes of '੬' or '٣'."""
    compiler = GrammarCompiler(ByteTokenizer(), 320, (257,))
    for rx, want in ((r"\d", DIGITS), (r"\w", WORD), (r"\s", SPACE), (r"[\d_]", DIGITS | {95}),
                     (r"[^\D]", DIGITS), (r"\\d", {ord("\\")}), (r"a/\d", {ord("a")})):
        assert _allowed(compiler.compile(StructuredOutput(regex=rx))) == want, rx
    other = _allowed(compiler.compile(StructuredOutput(regex=r"\D")))
    assert not other & DIGITS and {ord("a"), 0xD9, 0xE0} <= other  # '٣' starts D9, '੬' E0

    def after_quote(pattern: str) -> set[int]:
        c = compiler.compile(StructuredOutput(json={"type": "string", "pattern": pattern}))
        assert c.advance(ord('"'))
        return _allowed(c)
    assert after_quote(r"^\d+$") == DIGITS and after_quote(r"^\w$") == WORD
    # \t \n \r \f are written as JSON escapes, \v as \u000b: a space or a backslash; not
    # the lead bytes of U+00A0 (C2), U+2003 (E2), U+3000 (E3).
    assert after_quote(r"^\s$") == {ord(" "), ord("\\")}


PATTERNS = [r"\d{2,3}", r"\w+", r"a\sb", r"[\d_]+", r"[^\d\s]+", r"\\d", r"[\\d]+",
            r"\D\W\S", r"[\w.-]+@[\w-]+\.[a-z]{2,3}", r"x/\d", r"(?:\d|\s)+", r"[\s\S]{2}"]
TEXTS = ["123", "١٢٣", "੬੬", "12", "abc_9", "héllo", "a b", "a\u00a0b", "a\u2003b", "a\tb",
         "a\vb", "\\d", "d", "\\\\", "_1_2", "x/5", "x/٥", "a.b-c@d-e.com", "é@x.fr", "ab",
         "q!x", "é!\u00a0", "1 2\n3", "\u3000 "]


def test_regexes_mean_what_python_re_ascii_means():
    """Every pattern on every text: the constraint accepts exactly what ``re.fullmatch``
    with ``re.ASCII`` does (escaped backslashes, classes inside classes, negations)."""
    compiler = GrammarCompiler(ByteTokenizer(), 320, (257,))
    for p in PATTERNS:
        so = StructuredOutput(regex=p)
        got = {t for t in TEXTS if _accepts(compiler, so, t)}
        assert got == {t for t in TEXTS if re.fullmatch(p, t, re.ASCII)}, p
        assert got, p  # each pattern matches something here


def test_only_schema_positions_are_rewritten_and_a_lone_backslash_is_refused():
    from jserve.sampling.structured import ascii_schema
    schema = {"type": "object",
              "properties": {"pattern": {"const": r"\d"}, "code": {"pattern": r"\d"}},
              "patternProperties": {r"^\w+$": {"enum": [r"\s"]}},
              "$defs": {"x": {"pattern": r"\s"}}, "anyOf": [{"items": {"pattern": r"\d"}}],
              "default": {"pattern": r"\d"}}
    before = json.dumps(schema)
    out = ascii_schema(schema)
    assert json.dumps(schema) == before  # a copy
    assert out["properties"] == {"pattern": {"const": r"\d"}, "code": {"pattern": "[0-9]"}}
    assert out["patternProperties"] == {"^[0-9a-zA-Z_]+$": {"enum": [r"\s"]}}
    assert out["$defs"]["x"]["pattern"] == r"[ \t\n\r\f\v]"
    assert out["anyOf"][0]["items"]["pattern"] == "[0-9]"
    assert out["default"] == {"pattern": r"\d"}
    compiler = GrammarCompiler(ByteTokenizer(), 320, (257,))
    for so in (StructuredOutput(regex="ab\\"), StructuredOutput(json={"pattern": "a\\\\\\"})):
        with pytest.raises(ValueError, match=r"structured_output.(regex|json) is not a valid "
                                             r"constraint: .* lone backslash"):
            compiler.compile(so)
    assert _accepts(compiler, StructuredOutput(regex="ab\\\\"), "ab\\")  # an escaped one


# -- on the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from llm_helpers import small_llm
    return small_llm(max_num_seqs=32, max_num_batched_tokens=256)


def _sample(llm, so: StructuredOutput, n: int = 100, max_tokens: int = 120):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                             structured_output=so) for i in range(n)]
    return llm.generate([f"Case {i}:" for i in range(n)], params)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_100_sampled_outputs_all_follow_their_constraint(llm, kind):
    so, valid = {
        "json": (StructuredOutput(json=SCHEMA),
                 lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        "regex": (StructuredOutput(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
        "choice": (StructuredOutput(choice=CHOICES), lambda t: t in CHOICES),
        "grammar": (StructuredOutput(grammar=GRAMMAR), _arithmetic),
    }[kind]
    outs = _sample(llm, so)
    assert all(o.finish_reason == "stop" for o in outs), [
        (o.text, o.finish_reason) for o in outs if o.finish_reason != "stop"][:3]
    bad = [o.text for o in outs if not valid(o.text)]
    assert not bad, bad[:5]
    assert len({o.text for o in outs}) > (2 if kind == "choice" else 20)  # sampled, not fixed


@pytest.mark.slow
def test_any_json_object(llm):
    """Free-form strings of a random model rarely end: what ends parses as an object, what
    runs out of tokens is the start of one."""
    outs = _sample(llm, StructuredOutput(json=True), n=20, max_tokens=60)
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text
        else:
            assert o.finish_reason == "length" and o.text.startswith("{"), o.text


@pytest.mark.slow
def test_sampled_d_w_s_are_ascii_on_the_built_in_model(llm):
    """The issue's regex (it gave 'SEG-6੬𖄷߉') and a schema pattern with \\d \\s \\w: 100
    sampled outputs each, every class character ASCII."""
    outs = _sample(llm, StructuredOutput(regex=r"[A-Z]{3}-\d{4}"), max_tokens=40)
    assert [o.finish_reason for o in outs] == ["stop"] * 100
    bad = [o.text for o in outs if not re.fullmatch(r"[A-Z]{3}-[0-9]{4}", o.text)]
    assert not bad, bad[:5]
    schema = {"type": "object", "additionalProperties": False, "required": ["code"],
              "properties": {"code": {"type": "string", "pattern": r"^\d{3}\s\w{2}$"}}}
    outs = _sample(llm, StructuredOutput(json=schema), max_tokens=60)
    assert [o.finish_reason for o in outs] == ["stop"] * 100
    codes = [json.loads(o.text)["code"] for o in outs]
    bad = [c for c in codes if not re.fullmatch(r"[0-9]{3}[ \t\n\r\f\v][0-9A-Za-z_]{2}", c)]
    assert not bad, bad[:5]
    assert len(set(codes)) > 20 and len({c[3] for c in codes}) > 1  # sampled, \s varies


@pytest.mark.slow
def test_free_requests_beside_constrained_ones_get_the_same_tokens(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3
    prompts = ["alpha", "beta", "gamma"]
    alone = [o.token_ids for o in llm.generate(prompts, free)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=40,
                                  structured_output=StructuredOutput(regex=REGEX))] * 3
    mixed = llm.generate(["x", *prompts, "y", "z"], [constrained[0], *free, *constrained[1:]])
    assert [o.token_ids for o in mixed[1:4]] == alone
    assert all(re.fullmatch(REGEX, o.text) for o in (mixed[0], mixed[4], mixed[5]))


@pytest.mark.slow
def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    out = llm.generate("doc", SamplingParams(temperature=0.0, max_tokens=5,
                                             structured_output=StructuredOutput(json=SCHEMA)))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"')  # the start of a document, incomplete
    with pytest.raises(ValueError, match="structured_output.regex is not a valid"):
        llm.generate("x", SamplingParams(structured_output=StructuredOutput(regex="(")))


# -- over HTTP ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    from conftest import Served
    s = Served("--max-model-len", "2048", "--max-num-batched-tokens", "128")  # tools are long
    yield s
    s.close()


def _grammar_counts(url: str) -> tuple[float, float]:
    import httpx2 as httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                  if line.startswith("jserve_grammar_"))
    return (float(values["jserve_grammar_compiles_total"]),
            float(values["jserve_grammar_cache_hits_total"]))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_openai_response_format_json_schema(served, stream):
    import openai
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                      "strict": True}}
        kw = dict(model="default", messages=[{"role": "user", "content": "Who?"}],
                  response_format=rf, max_tokens=200, temperature=1.0, seed=7)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        r = client.completions.create(model="default", prompt="Pick:", max_tokens=20, n=3,
                                      seed=1, extra_body={"structured_outputs": {
                                          "choice": list(CHOICES)}})
        assert all(c.text in CHOICES for c in r.choices)


def test_bad_constraints_get_400_naming_the_field_and_hits_compile_nothing(served):
    import httpx2 as httpx

    def post(extra):
        return httpx.post(served.url + "/v1/completions", timeout=60, json={
            "model": "default", "prompt": "x", "max_tokens": 8, **extra})
    for extra, field in (({"structured_outputs": {"regex": "a[bc"}}, "structured_outputs"),
                         ({"structured_outputs": {"choice": []}}, "structured_outputs"),
                         ({"structured_outputs": {"grammar": "start: nope"}},
                          "structured_outputs"),
                         ({"response_format": {"type": "json_schema", "json_schema": {
                             "name": "x", "schema": {"type": "frobnicate"}}}},
                          "response_format"),
                         ({"response_format": {"type": "yaml"}}, "response_format")):
        r = post(extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (extra, r.text)
    regex = {"structured_outputs": {"regex": "[a-f]{4}"}}
    assert post(regex).status_code == 200
    compiles, hits = _grammar_counts(served.url)
    for _ in range(3):
        r = post(regex)
        assert re.fullmatch("[a-f]{4}", r.json()["choices"][0]["text"])
    assert _grammar_counts(served.url) == (compiles, hits + 3)


def test_grpc_carries_the_constraint_and_names_a_bad_one(served):
    import grpc

    from jserve.client import Client
    with Client(served.target) as c:
        out = c.generate("id:", SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                                               structured_output=StructuredOutput(regex=REGEX)))
        assert re.fullmatch(REGEX, out.text) and out.finish_reason
        with pytest.raises(grpc.RpcError) as e:
            c.generate("x", SamplingParams(structured_output=StructuredOutput(regex="(")))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("sampling_params.structured_output.regex is not a "
                                            "valid constraint"), e.value.details()


# -- tool calling over HTTP (the parsing and templates: tests/test_tool_calling.py) -------
def _tool_request(client, stream: bool, **kw):
    """A chat request's (message content, [(name, arguments)], finish_reason), streamed
    deltas put together as a client does (ids and names on a call's first delta only)."""
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert all(c.id.startswith("call_") and c.type == "function"
                   for c in m.tool_calls or [])
        return m.content, calls, r.choices[0].finish_reason
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_openai_tools_required_and_named_return_calls_that_validate(served, stream):
    import openai

    from test_tool_calling import TOOLS, USER
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        kw = dict(model="default", messages=USER, tools=TOOLS, temperature=1.0,
                  max_tokens=1000)
        for seed in (1, 2):
            content, calls, finish = _tool_request(client, stream, tool_choice="required",
                                                   seed=seed, **kw)
            assert finish == "tool_calls" and not content and calls
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), schemas[name])
        content, calls, finish = _tool_request(client, stream, tool_choice="required", seed=3,
                                               parallel_tool_calls=False, **kw)
        assert finish == "tool_calls" and len(calls) == 1
        named = {"type": "function", "function": {"name": "get_time"}}
        content, calls, finish = _tool_request(client, stream, tool_choice=named, seed=4, **kw)
        assert finish == "tool_calls" and not content and [c[0] for c in calls] == ["get_time"]
        jsonschema.validate(json.loads(calls[0][1]), schemas["get_time"])


def test_a_conversation_with_tool_results_goes_through_the_template(served):
    """``tool`` messages and an assistant's calls (arguments as the API's JSON strings) reach
    the built-in template: the prompt is exactly its rendering; the noise the random model
    answers with under ``auto`` is content."""
    import openai

    from jserve.tokenizer import ByteTokenizer, simple_chat_prompt
    from test_tool_calling import CONVERSATION, TOOLS
    api = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if "tool_calls" in m else m
        for m in CONVERSATION]
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        r = client.chat.completions.create(model="default", messages=api, tools=TOOLS,
                                           max_tokens=16, temperature=0.0)
        want = ByteTokenizer().encode(simple_chat_prompt(CONVERSATION, tools=TOOLS))
        assert r.usage.prompt_tokens == len(want)
        m = r.choices[0].message
        assert m.tool_calls is None and isinstance(m.content, str)
        assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_async_steps_send_masks_late_and_give_the_synchronous_tokens(llm, monkeypatch):
    """Under async scheduling a structured output decodes every step: its row runs in the
    next forward before its token is read, and its mask goes to the sampler after the read
    (``jserve.engine.loop.late_masks``). Sampled with seeds, constrained and free requests get the
    tokens of synchronous steps, every output valid, and the late path is what ran."""
    eng = llm.engine
    late = []
    from jserve.engine import engine as engine_module
    real = engine_module.late_bitmask
    monkeypatch.setattr(engine_module, "late_bitmask", lambda done, *a: late.append(
        len(done.late)) or real(done, *a))
    prompts = [f"Row {i}:" for i in range(10)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120,
                             structured_output=StructuredOutput(json=SCHEMA) if i % 3 else None)
              for i in range(10)]
    runs = {}
    for mode in (True, False):
        before = len(late)
        eng.async_scheduling = mode
        try:
            runs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            eng.async_scheduling = True
        assert (len(late) > before) == mode
    assert runs[True] == runs[False]
    outs = [eng.tokenizer.decode(t) for t, p in zip(runs[True], params) if p.structured_output]
    for text in outs:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert max(late) >= 5  # several constrained rows of one step sampled late together


@pytest.mark.slow
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_constrained_requests_survive_preemption_prefix_hits_and_stop_strings(preemption):
    """Under KV pressure (preempted and resumed mid-output), with prefix-cache hits on a
    second pass, and cut by a stop string, constrained requests give the tokens of a roomy
    run; blocks are conserved every step."""
    from llm_helpers import run_checked, small_llm
    from test_swap import TINY_POOL
    prompts = [f"Case {i}: " + "abcdefgh" * 4 for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_output=StructuredOutput(regex="[a-z]{40}"))
    roomy = small_llm()
    want = [o.token_ids for o in roomy.generate(prompts, greedy)]
    assert all(len(t) == 40 for t in want)
    tight = small_llm(preemption=preemption, **TINY_POOL)
    assert run_checked(tight, prompts, greedy) == want
    sched = tight.engine.scheduler
    assert sched.num_preemptions > 0
    assert (sched.num_swaps > 0) == (preemption == "swap")
    hits = sched.prefix_hit_tokens
    assert run_checked(tight, prompts, greedy) == want  # again, from the prefix cache
    assert sched.prefix_hit_tokens > hits
    text = roomy.tokenizer.decode(want[0])
    stop = text[10:12]
    cut = roomy.generate(prompts[0], dataclasses.replace(greedy, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]


@pytest.mark.slow
def test_a_step_sends_its_bitmask_only_when_a_row_is_constrained(llm, monkeypatch):
    """The structured-output bitmask ([rows, vocab/32]) is not in a step's packed buffers: a
    synchronous step sends it exactly when one of its rows is constrained, the rows it sends
    are the built ones, and the constrained outputs still follow their regex beside free
    requests whose tokens are those of a run without them."""
    eng = llm.engine
    built, sent = [], []
    build, execute = eng.builder.build, eng.runner.execute_packed
    monkeypatch.setattr(eng.builder, "build", lambda *a, **k: built.append(
        build(*a, **k)) or built[-1])
    monkeypatch.setattr(eng.runner, "execute_packed", lambda shape, i, f, masks=None, *a, **k: (
        sent.append(masks), execute(shape, i, f, masks, *a, **k))[1])
    free = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 2
    constrained = SamplingParams(temperature=0.0, max_tokens=30,
                                 structured_output=StructuredOutput(regex=REGEX))
    eng.async_scheduling = False
    try:
        alone = [o.token_ids for o in llm.generate(["alpha", "beta"], free)]
        assert built and not any(b.masked for b in built) and sent == [None] * len(built)
        built.clear(), sent.clear()
        mixed = llm.generate(["x", "alpha", "beta"], [constrained, *free])
    finally:
        eng.async_scheduling = True
    assert [o.token_ids for o in mixed[1:]] == alone and re.fullmatch(REGEX, mixed[0].text)
    assert len(sent) == len(built) and any(b.masked for b in built)
    assert not all(b.masked for b in built)  # the constrained one ends first
    for b, masks in zip(built, sent):
        assert (masks is not None) == b.masked
        if b.masked:
            np.testing.assert_array_equal(masks, b.arrays.sampling.allowed)
            assert (masks != -1).any()


def test_what_a_step_packs_does_not_grow_with_the_vocabulary():
    """The packed buffers of a bucket are the same size for a 320-token vocabulary and a
    128K one: only the bitmask, sent apart, has a row of vocab/32 words."""
    from jserve.engine.batch.arrays import PackedLayout, arrays_spec
    from jserve.engine.batch.buckets import Buckets
    buckets = Buckets(decode_rows=(0, 8), prefill_tokens=(0, 64), prefill_rows=2,
                      page_table_width=4)
    small, large = (PackedLayout(arrays_spec(buckets, v, 8, 64)) for v in (320, 128256))
    assert (small.int_size, small.float_size) == (large.int_size, large.float_size)
    assert (small.mask_shape, large.mask_shape) == ((10, 10), (10, 4008))

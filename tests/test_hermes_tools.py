"""The Hermes tool-call format (``--tool-call-parser hermes``; jserve/serving/hermes_tools.py):
outputs read into calls the same whole and streamed in any split, the grammar of
``tool_choice: required`` and of a named function (exactly what it accepts, on the byte
tokenizer), and a real ``jserve serve`` of a Qwen-style ChatML checkpoint whose template asks
for ``<tool_call>`` blocks, asked through the official ``openai`` client."""
from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest

from jserve.sampling.structured import GrammarCompiler
from jserve.serving.http_protocol import BadField, parse
from jserve.serving.tool_calls import ToolChoice
from jserve.serving.tool_formats import call_parser, constraint, read_calls
from jserve.tokenizer import ByteTokenizer
from test_tool_calling import CLOCK, TOOLS, USER

W = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
T = '{"name": "get_time", "arguments": {"zone": "CET"}}'
WA, TA = ("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", '{"zone": "CET"}')


def block(obj: str) -> str:
    return f"<tool_call>\n{obj}\n</tool_call>"


CASES = [  # (mode, output, content, [(name, arguments)])
    ("auto", "Sunny, 21 C <b>really</b> {}", "Sunny, 21 C <b>really</b> {}", []),
    ("auto", block(W), None, [WA]),
    ("auto", block(W) + "\n" + block(T), None, [WA, TA]),
    ("auto", "Let me look.\n" + block(W), "Let me look.\n", [WA]),
    ("auto", block(W) + "\nDone.", "Done.", [WA]),  # text after the calls: content too
    ("auto", "<tool_call>{\"name\":\"get_time\",\"arguments\":{\"zone\":\"a\\\"}</tool_call>\"}}"
             "</tool_call>", None, [("get_time", '{"zone":"a\\"}</tool_call>"}')]),
    # Arguments first (Hermes 2 Pro's own example): read once the block closes.
    ("auto", block('{"arguments": {"zone": "UTC"}, "name": "get_time"}'), None,
     [("get_time", '{"zone": "UTC"}')]),
    ("auto", block('{"name": "get_time", "parameters": {"zone": "UTC"}}'), None,
     [("get_time", '{"zone": "UTC"}')]),
    # A function not in tools is read as written (vLLM does the same; the client decides).
    ("auto", block('{"name": "launch_rocket", "arguments": {}}'), None,
     [("launch_rocket", "{}")]),
    ("auto", "<tool_call>\n" + W, None, [WA]),  # the last block cut before its tag
    # Malformed: the whole output is content.
    ("auto", block('{"name": "get_time", "arguments": {"zone": UTC}}'),
     block('{"name": "get_time", "arguments": {"zone": UTC}}'), []),
    ("auto", "Hm " + block("get_time(zone='UTC')"), "Hm " + block("get_time(zone='UTC')"), []),
    ("auto", block(W) + "\n" + block('{"name": 7}'), block(W) + "\n" + block('{"name": 7}'),
     []),
    ("auto", "<tool_call>\n{\"name\": \"get_time\", \"argu",
     "<tool_call>\n{\"name\": \"get_time\", \"argu", []),
    ("auto", "a <tool_ca", "a <tool_ca", []),  # a tag's start that never became one
    ("required", block(T) + "\n" + block(W), None, [TA, WA]),
    ("named", block(T), None, [TA]),
    ("none", block(T), block(T), []),
]
# What a stream sends where the whole answer is content: a call goes out as its text comes
# (vLLM streams the same), so a bad block after it, or its own arguments that turn out not to
# parse, cannot take it back.
STREAMED = {block(W) + "\n" + block('{"name": 7}'): (block('{"name": 7}'), [WA]),
            block('{"name": "get_time", "arguments": {"zone": UTC}}'):
                ("", [("get_time", '{"zone": UTC}')])}


def _stream(choice: ToolChoice, text: str, cuts: list[int]) -> tuple[str, list]:
    """``text`` fed in the pieces ``cuts`` make: (content, calls rebuilt from the deltas as a
    client does: a call's id and name on its first delta only)."""
    parser = call_parser(choice)
    bounds = [0, *cuts, len(text)]
    outs = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    content, calls = "", {}
    for c, deltas in outs:
        content += c
        for d in deltas:
            first = d["index"] not in calls
            assert ("id" in d) == first and ("name" in d["function"]) == first, d
            call = calls.setdefault(d["index"], [d["function"].get("name"), ""])
            call[1] += d["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def assert_read(choice: ToolChoice, text: str, content, want, stream_want, good_id) -> None:
    """``text`` read whole gives ``content`` and the calls ``want`` (each id ``good_id``),
    and streamed in 31 splits (30 random, one per character) ``stream_want``."""
    got_content, calls = read_calls(choice, text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want
    assert all(good_id(c["id"]) and c["type"] == "function" for c in calls)
    rng = random.Random(text)
    splits = [sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
              for _ in range(30)] + [list(range(1, len(text)))]
    for cuts in splits:
        assert _stream(choice, text, cuts) == stream_want, cuts


@pytest.mark.parametrize("mode, text, content, want", CASES)
def test_outputs_read_into_calls_the_same_whole_and_streamed_in_any_split(mode, text, content,
                                                                         want):
    choice = ToolChoice(mode, "get_time" if mode == "named" else None, format="hermes")
    assert_read(choice, text, content, want, STREAMED.get(text, (content or "", want)),
                lambda i: i.startswith("call_"))


def test_a_stream_sends_a_name_first_call_as_it_comes():
    parser = call_parser(ToolChoice("auto", format="hermes"))
    assert parser.feed("I'll check.\n<tool_") == ("I'll check.\n", [])
    assert parser.feed('call>\n{"name": "get_time", ') == ("", [])
    content, deltas = parser.feed('"arguments": {"zo')
    assert content == "" and len(deltas) == 1 and deltas[0]["function"] == {
        "name": "get_time", "arguments": '{"zo'}
    assert parser.feed('ne": "CET"}}\n</tool') == ("", [{"index": 0, "function": {
        "arguments": 'ne": "CET"}'}}])
    assert parser.feed("_call>") == ("", []) and parser.finish() == ("", [])
    assert parser.calls[0]["function"]["arguments"] == '{"zone": "CET"}'


# -- the grammar -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler():
    tok = ByteTokenizer()
    return tok, GrammarCompiler(tok, tok.vocab_size, tuple(tok.eos_token_ids))


def _accepts(compiler, so, text: str) -> bool:
    """Whether the grammar takes ``text`` whole (and may end there)."""
    tok, gc = compiler
    c = gc.compile(so)
    return all(c.advance(t) for t in tok.encode(text, add_special_tokens=False)) \
        and c._matcher.is_accepting()


def test_required_and_named_hold_the_output_to_blocks_of_the_given_functions(compiler):
    W1 = '{"name":"get_weather","arguments":{"city":"Lima","days":7}}'
    T1 = '{"name":"get_time","arguments":{"zone":"UTC"}}'
    required = constraint(TOOLS, ToolChoice("required", format="hermes"))
    for text in (block(W1), block(W1) + "\n" + block(T1) + "\n" + block(T1)):
        assert _accepts(compiler, required, text), text
    for text in ("", "Sure. " + block(T1), block(T1) + "\n", block(T1) + " " + block(T1),
                 block('{"name": "get_time", "arguments": {"zone": "UTC"}}'),  # not compact
                 block('{"arguments":{"zone":"UTC"},"name":"get_time"}'),  # name first
                 block('{"name":"get_weather","arguments":{"city":"Rome","days":1}}'),
                 block('{"name":"get_weather","arguments":{"city":"Lima","days":8}}'),
                 block('{"name":"get_time","arguments":{"zone":"utc"}}'),
                 block('{"name":"launch","arguments":{}}'), "<tool_call>" + T1 + "</tool_call>"):
        assert not _accepts(compiler, required, text), text
    single = constraint(TOOLS, ToolChoice("required", parallel=False, format="hermes"))
    assert _accepts(compiler, single, block(T1))
    assert not _accepts(compiler, single, block(T1) + "\n" + block(T1))
    named = constraint(TOOLS, ToolChoice("named", "get_time", format="hermes"))
    assert _accepts(compiler, named, block(T1)) and not _accepts(compiler, named, block(W1))
    assert not _accepts(compiler, named, block(T1) + "\n" + block(T1))
    assert constraint(TOOLS, ToolChoice("auto", format="hermes")) is None


@pytest.mark.slow
def test_tags_that_are_tokens_of_the_vocabulary_are_held_to_those_tokens():
    """Qwen's tokenizers have <tool_call> and </tool_call> as added tokens (not special in
    tokenizer.json; llguidance takes them for special ones, which no quoted text matches):
    the grammar names them as tokens, and the block the template's tokenizer writes is taken
    whole; spelled in smaller pieces it is not."""
    from hf_models import hermes_chat_dir
    from jserve.tokenizer import HFTokenizer
    tok = HFTokenizer(hermes_chat_dir())
    gc = GrammarCompiler(tok, 1216, tuple(tok.eos_token_ids))
    required = constraint(TOOLS, ToolChoice("required", format="hermes"), tok)
    assert "call: <tool_call> " in required.grammar and '"\\n" </tool_call>\n' in required.grammar
    text = block('{"name":"get_time","arguments":{"zone":"UTC"}}')
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok._tok.token_to_id("<tool_call>") and len(ids) < len(text)
    c = gc.compile(required)
    assert all(c.advance(t) for t in ids) and c._matcher.is_accepting()
    spelled = tok.encode("<", add_special_tokens=False) + tok.encode(
        "tool_call>", add_special_tokens=False)
    assert not gc.compile(required).advance(spelled[0])


def test_the_server_format_decides_what_a_request_is_held_to():
    body = {"model": "m", "messages": USER, "tools": TOOLS, "tool_choice": "required"}
    hermes = parse(body, "chat", tool_format="hermes")
    assert hermes.tool_choice == ToolChoice("required", format="hermes")
    assert hermes.params.structured_output.grammar == constraint(
        TOOLS, hermes.tool_choice).grammar and hermes.constraint_field == "tools"
    llama = parse(body, "chat")  # the default: llama3_json, a JSON array of calls
    assert llama.tool_choice.format == "llama3_json" and llama.params.structured_output.json
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "a\\"}}}}}
    with pytest.raises(BadField) as e:
        parse({**body, "tools": [CLOCK, bad]}, "chat", tool_format="hermes")
    assert e.value.field == "tools[1].function.parameters" and "lone backslash" in str(e.value)


# -- served ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    from conftest import Served
    from hf_models import hermes_chat_dir
    s = Served(str(hermes_chat_dir()), "--served-model-name", "qwen", "--tool-call-parser",
               "hermes", "--max-model-len", "2048", "--max-num-seqs", "16",
               "--max-num-batched-tokens", "256")
    yield s
    s.close()


def _ask(served, requests: list[dict]) -> list:
    """Chat completions through the official client, 16 at a time; a streamed one as
    (content, [(name, arguments)], finish_reason) put together from its chunks."""
    import openai

    async def one(client, kw):
        if not kw.get("stream"):
            return await client.chat.completions.create(**kw)
        content, calls, finish = None, {}, None
        async for chunk in await client.chat.completions.create(**kw):
            delta = chunk.choices[0].delta
            if delta.content:
                content = (content or "") + delta.content
            for d in delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function"
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return content, [tuple(calls[i]) for i in sorted(calls)], finish

    async def main():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            gate = asyncio.Semaphore(16)

            async def gated(kw):
                async with gate:
                    return await one(client, kw)
            return await asyncio.gather(*(gated(kw) for kw in requests))
    return asyncio.run(main())


def _calls(r) -> tuple:
    m = r.choices[0].message
    return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []], \
        r.choices[0].finish_reason


@pytest.mark.slow
def test_sampled_required_calls_validate_and_stream_as_they_answer(served):
    """12 sampled ``tool_choice: required`` answers are all calls (finish ``tool_calls``, no
    content) naming given functions with arguments that validate against their schemas; the
    same requests streamed add up to the same calls; one call with ``parallel_tool_calls:
    false``, the named function's with a named choice; the prompt is the template's."""
    from hf_models import hermes_chat_dir
    from jserve.tokenizer import HFTokenizer, chat_prompt_ids

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    base = dict(model="qwen", tools=TOOLS, temperature=1.0, max_tokens=1000)
    asks = [dict(base, messages=[{"role": "user", "content": f"Case {i}"}], seed=i,
                 tool_choice="required") for i in range(12)]
    single = [dict(a, parallel_tool_calls=False) for a in asks[:4]]
    named = [dict(a, tool_choice={"type": "function", "function": {"name": "get_time"}})
             for a in asks[:4]]
    rs = _ask(served, asks + [dict(a, stream=True) for a in asks[:6]] + single + named)
    whole, streamed, single, named = rs[:12], rs[12:18], rs[18:22], rs[22:]
    names = set()
    for r in whole + single + named:
        content, calls, finish = _calls(r)
        assert finish == "tool_calls" and content is None and calls, (content, calls)
        for name, arguments in calls:
            names.add(name)
            jsonschema.validate(json.loads(arguments), schemas[name])
    assert names == set(schemas)
    assert [s for s in streamed] == [_calls(r) for r in whole[:6]]
    assert all(len(_calls(r)[1]) == 1 for r in single)
    assert all([c[0] for c in _calls(r)[1]] == ["get_time"] for r in named)
    prompt = chat_prompt_ids(HFTokenizer(hermes_chat_dir()),
                             [{"role": "user", "content": "Case 0"}], tools=TOOLS)
    assert whole[0].usage.prompt_tokens == len(prompt)


@pytest.mark.slow
def test_an_auto_answer_of_noise_is_its_text(served):
    """The random model writes no block under ``auto``: the content is exactly the text the
    same request gets with ``tool_choice: none`` (the same prompt, output not read)."""
    auto, none = _ask(served, [dict(model="qwen", messages=USER, tools=TOOLS, max_tokens=24,
                                    temperature=0.0, tool_choice=c) for c in ("auto", "none")])
    content, calls, finish = _calls(auto)
    assert calls == [] and content and finish in ("stop", "length")
    assert (content, finish) == (none.choices[0].message.content, none.choices[0].finish_reason)

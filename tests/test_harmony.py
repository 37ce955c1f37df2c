"""gpt-oss's harmony replies (``--reasoning-parser openai_gptoss``, ``--tool-call-parser
openai``): the reader's split of constructed replies, whole or in pieces of any size; and a
transformers-written gpt-oss checkpoint with harmony's special tokens behind the real server
and the official ``openai`` client, its replies held to harmony by a grammar, whose reasoning,
answer and tool calls are those of the offline engine's raw text (decoded with its special
tokens, ``skip_special_tokens=False``), streamed or not."""
from __future__ import annotations

import json

import openai
import pytest

from hf_models import gpt_oss_chat_dir
from jserve import SamplingParams
from jserve.sampling.structured import GrammarCompiler, StructuredOutput
from jserve.serving.app import BackgroundServer, ServerConfig
from jserve.serving.harmony import HarmonyCallParser, HarmonyStream
from jserve.serving.reasoning import FORMATS, split
from jserve.serving.tool_calls import ToolChoice
from jserve.serving.tool_formats import read_calls
from llm_helpers import small_llm

HARMONY = FORMATS["openai_gptoss"]
AUTO = ToolChoice("auto", format="openai")
CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>'
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
REPLIES = {  # reply -> (reasoning, content, calls as (name, arguments))
    "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Hello there.": ("User greets.", "Hello there.", []),
    "<|channel|>final<|message|>Just <b>this</b> <| not a marker": (
        None, "Just <b>this</b> <| not a marker", []),
    "<|channel|>analysis<|message|>Cut short in thought": ("Cut short in thought", None, []),
    "<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary"
    "<|message|>Checking now.<|end|><|start|>assistant<|channel|>final<|message|>Done.": (
        "Plan.", "Checking now.Done.", []),
    CALL: ("Need the weather.", None, [("get_weather", '{"city": "Paris"}')]),
    "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}": (
        None, None, [("get_time", "{}")]),
    '{"answer": 42}': (None, '{"answer": 42}', []),  # held by a structured output: no header
    "<|channel|>final": (None, None, []),  # a header cut short says nothing
}


def read(reply: str, size: int) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """``reply`` read as a stream in pieces of ``size`` characters, through both readers."""
    reasoner, caller = HarmonyStream(), HarmonyCallParser(AUTO)
    reasoning = content = ""
    for piece in [reply[i:i + size] for i in range(0, len(reply), size)] + [None]:
        r, c = reasoner.feed(piece) if piece is not None else reasoner.finish()
        got, _ = caller.feed(c)
        if piece is None:
            rest, _ = caller.finish()
            got += rest
        reasoning, content = reasoning + r, content + got
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in caller.calls]
    return reasoning or None, content or None, calls


@pytest.mark.parametrize("reply", list(REPLIES), ids=range(len(REPLIES)))
def test_a_reply_splits_the_same_whole_or_in_pieces_of_any_size(reply):
    want = REPLIES[reply]
    reasoning, content = split(HARMONY, reply)
    content, calls = read_calls(AUTO, content) if content else (content, [])
    assert (reasoning, content, [(c["function"]["name"], c["function"]["arguments"])
                                 for c in calls]) == want
    for size in range(1, 12):
        assert read(reply, size) == want, size


def test_an_openai_tool_parser_needs_the_harmony_reasoning_parser():
    with pytest.raises(ValueError, match="openai_gptoss"):
        ServerConfig(tool_call_parser="openai")
    assert ServerConfig(tool_call_parser="openai", reasoning_parser="openai_gptoss")


# -- served --------------------------------------------------------------------------------
# Replies held to harmony by a Lark grammar (llguidance's: ``<|channel|>`` is the special
# token; a quoted literal or a regex never matches one).
ANSWER = ('%llguidance {}\nstart: <|channel|> "analysis" <|message|> /[a-z]{2,6}( [a-z]{2,6})'
          '{1,3}/ <|end|> <|start|> "assistant" <|channel|> "final" <|message|> '
          '/[a-z]{2,6}( [a-z]{2,6}){1,2}/\n')
CALLING = ('%llguidance {}\nstart: <|channel|> "analysis" <|message|> /[a-z]{2,6} [a-z]{2,6}/ '
           '<|end|> <|start|> "assistant" <|channel|> "commentary to=functions.get_weather " '
           '<|constrain|> "json" <|message|> "{\\"city\\": \\"" /[a-z]{2,6}/ "\\"}"\n')
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
BOTH = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def model() -> str:
    return str(gpt_oss_chat_dir())


@pytest.fixture(scope="module")
def offline(model):
    return small_llm(model)


@pytest.fixture(scope="module")
def oai(model):
    server = BackgroundServer(small_llm(model).engine, ServerConfig(
        host="127.0.0.1", port=0, http_port=0, metrics_port=None, served_model_names=("oss",),
        reasoning_parser="openai_gptoss", tool_call_parser="openai"))
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="-", max_retries=0,
                       timeout=120) as client:
        yield client
    server.stop(grace=0)


def raw(offline, grammar: str, tools=None) -> str:
    """The offline engine's reply to MSGS held to ``grammar``, its special tokens kept."""
    prompt = offline.engine.tokenizer.apply_chat_template(MSGS, tools=tools)
    params = SamplingParams(temperature=0.0, max_tokens=60, skip_special_tokens=False,
                            structured_output=StructuredOutput(grammar=grammar))
    return offline.generate(prompt, params)[0].text


def test_served_reasoning_and_answer_are_the_raw_replys(oai, offline):
    text = raw(offline, ANSWER)
    assert text.startswith("<|channel|>analysis<|message|>") and "<|end|>" in text
    reasoning, content = split(HARMONY, text)
    body = dict(model="oss", messages=MSGS, temperature=0, max_tokens=60,
                extra_body={"structured_outputs": {"grammar": ANSWER}})
    msg = oai.chat.completions.create(**body).choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == (reasoning, content)
    assert "<|" not in reasoning + content
    chunks = list(oai.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    # The markers are special tokens the default decoding drops: a completion keeps them
    # only when asked.
    tok = offline.engine.tokenizer
    channel = tok.encode("<|channel|>", add_special_tokens=False)
    assert len(channel) == 1
    forced = dict(model="oss", prompt="hi", max_tokens=3, temperature=0,
                  extra_body={"logit_bias": {str(channel[0]): 100}})
    assert oai.completions.create(**forced).choices[0].text == ""
    forced["extra_body"]["skip_special_tokens"] = False
    assert oai.completions.create(**forced).choices[0].text == "<|channel|>" * 3


def test_served_tool_calls_are_the_raw_replys(oai, offline):
    text = raw(offline, CALLING, TOOLS)
    reasoning, content = split(HARMONY, text)
    _, calls = read_calls(AUTO, content)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    body = dict(model="oss", messages=MSGS, tools=TOOLS, temperature=0, max_tokens=60,
                extra_body={"structured_outputs": {"grammar": CALLING}})
    choice = oai.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning"] == reasoning
    got = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert set(json.loads(got[0].function.arguments)) == {"city"}
    streamed, finish = {}, None
    for chunk in oai.chat.completions.create(**body, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert streamed == {0: [got[0].function.name, got[0].function.arguments]}


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_choices_hold_the_reply_to_a_call(oai, offline, tool_choice):
    """``required`` / a named function: the reply is held to (an analysis message, then) a
    call message to one of the tools, its arguments to that tool's parameters; served, it
    is that call, as the offline engine's raw reply under the same constraint reads."""
    from jserve.serving.tool_formats import constraint

    tools = BOTH
    named = isinstance(tool_choice, dict)
    choice = ToolChoice("named", name="get_time", format="openai") if named else \
        ToolChoice("required", format="openai")
    held = constraint(tools, choice, offline.engine.tokenizer)
    prompt = offline.engine.tokenizer.apply_chat_template(MSGS, tools=tools)
    text = offline.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=60, skip_special_tokens=False,
        structured_output=held))[0].text
    _, content = split(HARMONY, text)
    _, calls = read_calls(AUTO, content)
    assert len(calls) == 1, text
    name, arguments = calls[0]["function"]["name"], calls[0]["function"]["arguments"]
    if named:
        assert name == "get_time" and set(json.loads(arguments)) == {"zone"}
    # An analysis message may come first; nothing but a call to a given tool may follow.
    tok, eos = offline.engine.tokenizer, tuple(offline.engine.tokenizer.eos_token_ids)
    grammars = GrammarCompiler(tok, offline.engine.model_config.vocab_size, eos)
    think = ("<|channel|>analysis<|message|>Time, then.<|end|><|start|>assistant"
             '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>')
    for reply, whole in [(think + '{"zone":"UTC"}', True), (think + '{"zone":"Europe/Paris"}',
                                                             False),
                         ("<|channel|>final<|message|>It is noon.", False),
                         ('<|channel|>commentary to=functions.get_date <|constrain|>json'
                          '<|message|>{}', False)]:
        held_to = grammars.compile(held)
        ids = tok.encode(reply, add_special_tokens=False)
        taken = all(held_to.advance(i) for i in ids)
        assert (taken and held_to.done) == whole, reply
    choice = oai.chat.completions.create(model="oss", messages=MSGS, tools=tools,
                                         tool_choice=tool_choice, temperature=0,
                                         max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (name, arguments)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_carries_harmonys_reasoning_and_its_call(oai, offline, stream):
    """The Responses API on the harmony readers: the analysis body a reasoning item and the
    final body the message (a reply held to both by ANSWER), and a required call a
    function_call item; each as the chat reply to the same input gives it."""
    kw = dict(model="oss", input=MSGS[0]["content"], temperature=0, max_output_tokens=60)

    def respond(**more):
        if not stream:
            return oai.responses.create(**kw, **more)
        events = list(oai.responses.create(stream=True, **kw, **more))
        r = events[-1].response
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == "".join(o.content[0].text for o in r.output if o.type == "reasoning")
        return r
    chat = dict(model="oss", messages=MSGS, temperature=0, max_tokens=60)
    grammar = {"structured_outputs": {"grammar": ANSWER}}
    m = oai.chat.completions.create(**chat, extra_body=grammar).choices[0].message
    r = respond(extra_body=grammar)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == m.model_extra["reasoning"]
    assert r.output_text == m.content and "<|" not in r.output_text
    # (A random model in an analysis body rarely leaves it: with these tools its greedy
    # reply goes to the call at once.)
    call = oai.chat.completions.create(**chat, tools=BOTH, tool_choice="required"
                                       ).choices[0].message.tool_calls[0].function
    r = respond(tools=[{"type": "function", **t["function"]} for t in BOTH],
                tool_choice="required")
    assert [(o.type, o.name, o.arguments) for o in r.output] == [
        ("function_call", call.name, call.arguments)]


def test_a_regex_spelling_a_markers_text_makes_that_text(offline):
    """A regex whose forced bytes spell a special token's text: llguidance's mask offers the
    special token alone, which its matcher then refuses (the request ended there, empty);
    the constraint offers the text instead, so the reply is the text, whole."""
    prompt = offline.engine.tokenizer.apply_chat_template(MSGS)
    for regex in (r"<\|channel\|>final", r"(ok|no) <\|end\|>"):
        out = offline.generate(prompt, SamplingParams(
            temperature=0.0, max_tokens=30, skip_special_tokens=False,
            structured_output=StructuredOutput(regex=regex)))[0]
        assert out.finish_reason == "stop"
        assert out.text in ("<|channel|>final", "ok <|end|>", "no <|end|>"), out.text
        assert "<|channel|>" not in [offline.engine.tokenizer.decode(
            [t], skip_special_tokens=False) for t in out.token_ids]

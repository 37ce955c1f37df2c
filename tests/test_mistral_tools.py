"""Mistral's tool-call format (``--tool-call-parser mistral``; jserve/serving/mistral_tools.py):
outputs read into calls the same whole and streamed in any split, with or without a visible
``[TOOL_CALLS]``; nine-character call ids; the grammar of ``tool_choice: required``; and a real
``jserve serve`` of a transformers-written Mistral checkpoint whose template (Mistral's shape:
``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]``, ``[TOOL_RESULTS]``) refuses other ids, asked through
the official ``openai`` client for a call and then with the call's result."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jserve.sampling.structured import GrammarCompiler
from jserve.serving.tool_calls import ToolChoice
from jserve.serving.tool_formats import constraint
from jserve.tokenizer import ByteTokenizer
from test_hermes_tools import assert_read
from test_tool_calling import TOOLS, WEATHER

W = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
T = '{"name": "get_time", "arguments": {"zone": "CET"}}'
WA, TA = ("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", '{"zone": "CET"}')
NINE = re.compile(r"[A-Za-z0-9]{9}")

CASES = [  # (mode, output, content, [(name, arguments)])
    ("auto", f" [{W}]", None, [WA]),                  # the control token decoded away
    ("auto", f"[TOOL_CALLS] [{W}, {T}]", None, [WA, TA]),  # kept as text
    ("auto", f"[TOOL_CALLS][{T}]", None, [TA]),
    ("auto", "It is sunny in Oslo.", "It is sunny in Oslo.", []),
    ("auto", "[TOOL", "[TOOL", []),                   # ended inside a would-be mark
    ("auto", "[TOOLS are fun]", "[TOOLS are fun]", []),
    ("auto", '[TOOL_CALLS] [{"name": "get_time", "parameters": {"zone": "CET"}}]', None,
     [TA]),
    ("required", f" [{T}, {W}]", None, [TA, WA]),
    ("named", '{"zone": "CET"}', None, [TA]),
    ("none", f"[TOOL_CALLS] [{T}]", f"[TOOL_CALLS] [{T}]", []),
]


@pytest.mark.parametrize("mode, text, content, want", CASES)
def test_outputs_read_into_calls_the_same_whole_and_streamed_in_any_split(mode, text, content,
                                                                         want):
    choice = ToolChoice(mode, "get_time" if mode == "named" else None, format="mistral")
    assert_read(choice, text, content, want, (content or "", want), NINE.fullmatch)


def test_required_holds_the_output_to_an_array_of_the_given_functions():
    tok = ByteTokenizer()
    gc = GrammarCompiler(tok, tok.vocab_size, tuple(tok.eos_token_ids))

    def accepts(so, text):
        c = gc.compile(so)
        return all(c.advance(t) for t in tok.encode(text, add_special_tokens=False)) \
            and c._matcher.is_accepting()
    t1 = '{"name":"get_time","arguments":{"zone":"UTC"}}'
    w1 = '{"name":"get_weather","arguments":{"city":"Lima","days":7}}'
    required = constraint(TOOLS, ToolChoice("required", format="mistral"))
    for text in (f"[{t1}]", f"[TOOL_CALLS] [{w1},{t1}]", f"[TOOL_CALLS][{t1}]"):
        assert accepts(required, text), text
    for text in ("", "[]", f"Sure. [{t1}]", f"[{t1}] ", "[TOOL_CALLS]  [" + t1 + "]",
                 '[{"name":"get_time","parameters":{"zone":"UTC"}}]',  # Mistral's key
                 '[{"name": "get_time", "arguments": {"zone": "UTC"}}]',  # not compact
                 '[{"name":"get_time","arguments":{"zone":"utc"}}]',
                 '[{"name":"launch","arguments":{}}]'):
        assert not accepts(required, text), text
    single = constraint(TOOLS, ToolChoice("required", parallel=False, format="mistral"))
    assert accepts(single, f"[{t1}]") and not accepts(single, f"[{t1},{t1}]")
    named = constraint(TOOLS, ToolChoice("named", "get_time", format="mistral"))
    assert accepts(named, '{"zone":"UTC"}') and not accepts(named, f"[{t1}]")


# -- served ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_mistral_checkpoint_calls_and_takes_the_result_back():
    """``tool_choice: required`` on a random Mistral checkpoint: calls of the given
    functions with valid arguments and nine-character ids; the conversation with the call
    and its result then renders through Mistral's template (which refuses any other id, as
    the same turn with an OpenAI-style id shows) and is answered."""
    import openai
    import transformers

    from conftest import Served
    from hf_models import mistral_tools_dir
    served = Served(str(mistral_tools_dir()), "--served-model-name", "mistral",
                    "--tool-call-parser", "mistral", "--max-model-len", "512")
    try:
        user = [{"role": "user", "content": "Weather in Oslo for two days?"}]
        with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) as client:
            r = client.chat.completions.create(model="mistral", messages=user, tools=TOOLS,
                                               tool_choice="required", max_tokens=120,
                                               temperature=0)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
            for c in calls:
                assert NINE.fullmatch(c.id) and c.function.name in schemas
                jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
            call = calls[0]
            turn = user + [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
            answer = client.chat.completions.create(model="mistral", messages=turn,
                                                    tools=[WEATHER], max_tokens=8,
                                                    temperature=0)
            assert answer.choices[0].finish_reason in ("stop", "length")
            # The prompt the template made of the call and its result, as transformers does.
            hf = transformers.AutoTokenizer.from_pretrained(mistral_tools_dir())
            as_hf = json.loads(json.dumps(turn))
            as_hf[1]["tool_calls"][0]["function"]["arguments"] = json.loads(
                call.function.arguments)
            ids = hf.encode(hf.apply_chat_template(as_hf, tools=[WEATHER], tokenize=False),
                            add_special_tokens=False)  # the template writes BOS itself
            assert answer.usage.prompt_tokens == len(ids)
            assert call.id in hf.decode(ids)
            other = json.loads(json.dumps(turn))
            other[1]["tool_calls"][0]["id"] = other[2]["tool_call_id"] = "call_0123456789"
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="mistral", messages=other, max_tokens=8)
            assert "length 9" in str(e.value) and "messages" in str(e.value)
    finally:
        served.close()

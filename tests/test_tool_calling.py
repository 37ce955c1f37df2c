"""Tool calling (issue 27): ``tools``/``tool_choice`` checked field by field, the constraint
they put on the output, the chat templates' tools section (the built-in one exactly, a
checkpoint's as transformers renders it) and the reading of outputs back into ``tool_calls``,
streamed in any split. Live requests through the ``openai`` client are in
tests/test_structured_output.py (they share its server)."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from jserve.serving.http_protocol import BadField, parse
from jserve.serving.tool_calls import (
    ToolCallParser,
    ToolChoice,
    read_tool_calls,
    tool_constraint,
)
from jserve.tokenizer import TOOL_CALL_INSTRUCTION, HFTokenizer, simple_chat_prompt

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}}
TOOLS = [WEATHER, CLOCK]
USER = [{"role": "user", "content": "Weather in Oslo?"}]


def _chat(**extra) -> dict:
    return {"model": "m", "messages": USER, **extra}


@pytest.mark.parametrize("extra, field", [
    ({"tools": []}, "tools"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
     "tools[0].function.returns"),
    ({"tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "3", "tool_call_id": 7}]},
     "messages[0].tool_call_id"),
])
def test_bad_tools_are_refused_naming_the_field(extra, field):
    with pytest.raises(BadField) as e:
        parse(_chat(**extra), "chat")
    assert e.value.field == field and field.split("[")[0] in e.value.message, e.value.message


def test_tool_choice_decides_the_constraint():
    auto = parse(_chat(tools=TOOLS), "chat")
    assert auto.tool_choice == ToolChoice("auto") and auto.params.structured_output is None
    none = parse(_chat(tools=TOOLS, tool_choice="none"), "chat")
    assert not none.tool_choice.parses and none.tools == TOOLS
    named = parse(_chat(tools=TOOLS, tool_choice={"type": "function",
                                                  "function": {"name": "get_time"}}), "chat")
    assert named.tool_choice == ToolChoice("named", "get_time")
    assert named.params.structured_output.json == CLOCK["function"]["parameters"]
    assert named.constraint_field == "tools"
    required = parse(_chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                     "chat")
    schema = required.params.structured_output.json
    one = [{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}}]
    jsonschema.validate(one, schema)
    for bad in ([], one * 2, [{"name": "get_time", "parameters": {"city": "Lima"}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    parallel = tool_constraint(TOOLS, ToolChoice("required")).json
    jsonschema.validate(one * 3, parallel)


def _stream(choice: ToolChoice, text: str, cuts: list[int]) -> tuple[str, list[dict], list]:
    """``text`` fed in the pieces ``cuts`` make: (content, calls rebuilt from the deltas as a
    client does, the parser's own calls)."""
    parser = ToolCallParser(choice)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    for c, deltas in outs:
        content += c
        for d in deltas:
            call = calls.setdefault(d["index"], {"id": d.get("id"), "name": None,
                                                 "arguments": ""})
            assert ("id" in d) == (call["name"] is None)  # id and name once, first
            call["name"] = call["name"] or d["function"].get("name")
            call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], parser.calls


CASES = [  # (mode, output, content, [(name, arguments)])
    ("auto", 'Sunny, 21 C {really}', "Sunny, 21 C {really}", []),
    ("auto", ' {"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}', None,
     [("get_weather", '{"city": "Oslo", "days": 2}')]),
    ("auto", '{"name":"get_time","arguments":{"zone":"a\\"}{"}}; {"name": "get_weather", '
             '"parameters": {"city": "Lima", "days": [1, {"x": "]"}]}}', None,
     [("get_time", '{"zone":"a\\"}{"}'), ("get_weather", '{"city": "Lima", "days": [1, {"x": '
                                                          '"]"}]}')]),
    ("auto", '[1, 2, {"name": 3}]', '[1, 2, {"name": 3}]', []),
    ("auto", '{"name": "get_time", "param', '{"name": "get_time", "param', []),
    ("auto", '{"city": "Oslo"}', '{"city": "Oslo"}', []),
    ("required", '[{"name":"get_time","parameters":{"zone":"UTC"}},{"name":"get_weather",'
                 '"parameters":{"city":"Paris","days":7}}]', None,
     [("get_time", '{"zone":"UTC"}'), ("get_weather", '{"city":"Paris","days":7}')]),
    ("named", '{"zone":"CET"}', None, [("get_time", '{"zone":"CET"}')]),
    ("none", '{"name": "get_time", "parameters": {}}', '{"name": "get_time", "parameters": {}}',
     []),
]


@pytest.mark.parametrize("mode, text, content, want", CASES)
def test_outputs_read_into_calls_the_same_in_any_split(mode, text, content, want):
    choice = ToolChoice(mode, "get_time" if mode == "named" else None)
    got_content, got_calls = read_tool_calls(choice, text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == want
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
        streamed, calls, _ = _stream(choice, text, cuts)
        assert streamed == (content or ""), cuts
        assert [(c["name"], c["arguments"]) for c in calls] == want, cuts
    per_char = _stream(choice, text, list(range(1, len(text))))
    assert [(c["name"], c["arguments"]) for c in per_char[1]] == want


def test_an_auto_output_whose_arguments_do_not_parse_is_content():
    text = '{"name": "get_time", "parameters": {"zone": tomorrow}}'
    assert read_tool_calls(ToolChoice("auto"), text) == (text, [])


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    *USER,
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    {"role": "tool", "tool_call_id": "call_2", "content": "09:12"},
]


def test_the_built_in_template_has_a_tools_section_and_writes_calls_as_they_are_read():
    text = simple_chat_prompt(CONVERSATION, tools=TOOLS)
    calls = ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
             '{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert text == ("<|tools|>\n" + json.dumps(WEATHER) + "\n" + json.dumps(CLOCK) + "\n"
                    + TOOL_CALL_INSTRUCTION + "\n<|system|>\nBe brief.\n<|user|>\n"
                    "Weather in Oslo?\n<|assistant|>\n" + calls + "\n<|tool|>\n-3 C, snow\n"
                    "<|tool|>\n09:12\n<|assistant|>\n")
    assert simple_chat_prompt(USER) == simple_chat_prompt(USER, tools=None)  # as before
    # What the template writes for an assistant's calls reads back as those calls.
    _, read = read_tool_calls(ToolChoice("auto"), calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in CONVERSATION[2]["tool_calls"]]


# A Llama 3.1-style template written for this test: tools in the system turn, calls as JSON,
# tool results under the ipython role.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools is not none %}<|system|>\nFunctions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|ipython|>\n{{ m.content }}{{ eos_token }}"
    "{% elif m.tool_calls %}<|assistant|>\n{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "{% if not loop.last %}; {% endif %}{% endfor %}{{ eos_token }}"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_checkpoint_template_gets_tools_as_transformers_passes_them(tmp_path):
    from transformers import AutoTokenizer

    from hf_models import write_tiny_tokenizer
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = HFTokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for tools in (TOOLS, None):
        want = ref.apply_chat_template(CONVERSATION, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
        assert ours.apply_chat_template(CONVERSATION, tools=tools) == want
        assert (json.dumps(CLOCK, ensure_ascii=False) in want) == (tools is not None)
        assert '{"name": "get_time", "parameters": {"zone": "CET"}}' in want

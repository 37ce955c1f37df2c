"""The Responses API (issue 61): a Responses body read into the chat body it means, field by
field, its refusals named as the Responses API names its fields; the stored conversations;
the event stream against the whole reply; and the official ``openai`` client's
``client.responses`` against a real ``jserve serve``: the same tokens as the chat endpoint,
a tool call and its result sent back through ``previous_response_id``, JSON-schema output,
stored responses retrieved and deleted, no KV page left."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import conftest
from conftest import Served
from jserve.serving import responses_api as ra
from jserve.serving.http_protocol import BadField, parse
from test_structured_output import SCHEMA
from test_tool_calling import CLOCK, WEATHER

TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]  # Responses' spelling
CHAT_TOOLS = [WEATHER, CLOCK]


def _chat(body: dict, store: ra.ResponseStore | None = None) -> tuple[dict, ra.Asked]:
    return ra.to_chat({"model": "m", **body},
                      ra.ResponseStore(1 << 20) if store is None else store)


def test_input_items_and_fields_become_the_chat_body_they_mean():
    call = {"type": "function_call", "call_id": "c1", "name": "get_time",
            "arguments": '{"zone": "CET"}', "id": "fc_1", "status": "completed"}
    chat, asked = _chat({
        "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "seed": 3,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Time "}, {"type": "input_text",
                                                                  "text": "in Oslo?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking."}]},
            call, {**call, "call_id": "c2", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "09:12"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "?"}]}],
        "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"},
        "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}},
        "reasoning": {"effort": "low", "summary": "auto"}})
    calls = [{"id": i, "type": "function", "function": {"name": "get_time", "arguments": a}}
             for i, a in (("c1", '{"zone": "CET"}'), ("c2", "{}"))]
    conversation = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Time in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "09:12"},
        {"role": "tool", "tool_call_id": "c2", "content": "?"}]
    assert chat == {
        "model": "m", "temperature": 0.5, "seed": 3, "max_tokens": 9,
        "messages": [{"role": "system", "content": "Be brief."}, *conversation],
        "tools": CHAT_TOOLS, "tool_choice": {"type": "function",
                                             "function": {"name": "get_time"}},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "p", "schema": SCHEMA}},
        "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert asked.conversation == conversation and asked.store  # no instructions kept
    assert asked.echoed["instructions"] == "Be brief." and asked.echoed["tools"] == TOOLS
    assert _chat({"input": "hi"})[0] == {"model": "m", "messages": [
        {"role": "user", "content": "hi"}]}


def _refused_field(body: dict) -> str | None:
    """The field a Responses body is refused for, by ``to_chat`` or by the chat endpoint's
    ``parse`` of what it became (as the server runs it)."""
    with pytest.raises(BadField) as e:
        chat, _ = _chat(body)
        try:
            parse(chat, "chat")
        except BadField as err:
            raise ra.renamed(err) from None
    assert e.value.field is None or e.value.field.split("[")[0].split(".")[0] in {
        *ra.FIELDS, *body}
    return e.value.field


@pytest.mark.parametrize("body, field", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 7}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": "{x"}]}, "input"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "returns": {}}]},
     "tools[0].returns"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p",
                                        "schema": "{}"}}}, "text.format"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "text": {"format": {"type": "json_object"}},
      "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"input": "x", "structured_outputs": {"regex": 3}}, "structured_outputs"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "previous_response_id": ["resp_nope"]}, "previous_response_id"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "messages": []}, "messages"),
])
def test_bad_bodies_are_refused_naming_the_responses_field(body, field):
    assert _refused_field(body) == field


def test_a_previous_response_continues_its_conversation_without_its_instructions():
    store = ra.ResponseStore(1 << 20)
    first, asked = _chat({"input": "Hi", "instructions": "Be brief."}, store)
    items = ra.output_items({"role": "assistant", "content": "Hello.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        "stop")
    r = ra.response("resp_1", "m", asked, 0, "completed", items, ra.usage(3, 2, 0))
    assert [it["type"] for it in items] == ["message", "function_call"]
    assert store.put(r, asked.conversation + [ra.reply_message(items)])
    chat, _ = _chat({"input": [{"type": "function_call_output", "call_id": "c1",
                                "output": "ok"}], "previous_response_id": "resp_1",
                     "instructions": "Be kind."}, store)
    assert chat["messages"] == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert not _chat({"input": "x"}, ra.ResponseStore(0))[1].store  # the server keeps none
    assert not _chat({"input": "x", "store": False}, store)[1].store


def test_the_store_keeps_its_bytes_and_drops_the_least_recently_used():
    def put(store, rid, text):
        r = {"id": rid, "text": text}
        return store.put(r, [{"role": "user", "content": text}])
    one = len(json.dumps({"id": "a", "text": "x" * 100})) + len(json.dumps(
        [{"role": "user", "content": "x" * 100}]))
    store = ra.ResponseStore(3 * one)
    for rid in "abc":
        assert put(store, rid, "x" * 100)
    assert store.get("a") is not None  # now the most recent
    assert put(store, "d", "x" * 100)
    assert [k for k in "abcd" if store.get(k) is not None] == ["a", "c", "d"]
    assert not put(store, "e", "x" * (3 * one))  # alone over the bound: not kept
    assert len(store) == 3 and store.delete("c") and not store.delete("c")
    assert store._bytes == 2 * one


def _replay(deltas: list[dict], finish: str) -> tuple[list[dict], ra.EventWriter]:
    writer = ra.EventWriter({"id": "r", "status": "in_progress"})
    events = writer.begin()
    for d in deltas:
        events += writer.feed(d)
    return events + writer.end(finish), writer


def test_the_event_stream_builds_the_items_of_the_whole_reply():
    """Chat stream deltas (reasoning, content, two calls in OpenAI's chunked form) as
    Responses events: numbered, each item added, its pieces, done; the items are those the
    whole reply makes."""
    deltas = [{"role": "assistant", "reasoning": "Think"}, {"reasoning": "ing."},
              {"content": "Call"}, {"content": "ing:"},
              {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                               "function": {"name": "get_time", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone"'}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": ': "CET"}'}}]},
              {"tool_calls": [{"index": 1, "id": "c2", "type": "function",
                               "function": {"name": "get_weather",
                                            "arguments": '{"city": "Oslo"}'}}]}]
    events, writer = _replay(deltas, "stop")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    whole = ra.output_items({"content": "Calling:", "reasoning": "Thinking.", "tool_calls": [
        {"id": "c1", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        {"id": "c2", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        "stop")

    def strip(items):
        return [{k: v for k, v in it.items() if k != "id"} for it in items]
    assert strip(writer.items) == strip(whole)
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == [
        "created", "in_progress",
        "output_item.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done"]
    for e in events:
        if "output_index" in e and "item_id" in e:
            assert e["item_id"] == writer.items[e["output_index"]]["id"]
    events, writer = _replay([{"role": "assistant", "content": ""}], "length")
    assert strip(writer.items) == strip(ra.output_items({"content": ""}, "length"))
    assert writer.items[0]["status"] == "incomplete"
    events, writer = _replay([{"reasoning": "Hm"}], "length")  # thought to the end
    assert strip(writer.items) == strip(ra.output_items({"reasoning": "Hm", "content": None},
                                                        "length"))
    assert [it["type"] for it in writer.items] == ["reasoning", "message"]


# -- served ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    s = Served("--max-model-len", "2048", "--max-num-batched-tokens", "128")  # tools are long
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


def _streamed(client, **kw):
    """A streamed response: the final Response, the text its deltas make, and the events."""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.item_id] = args.get(e.item_id, "") + e.delta
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"
    for item in final.output:
        if item.type == "function_call":
            assert args.get(item.id, "") == item.arguments
    return final, text, events


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_is_the_chat_reply_to_the_same_messages(client, stream):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="default", messages=messages, max_tokens=12,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    kw = dict(model="default", instructions="Be brief.", input="Name a colour.",
              max_output_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    if stream:
        r, text, _ = _streamed(client, **kw)
        assert text == r.output_text
    else:
        r = client.responses.create(**kw)
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.store
    assert [o.type for o in r.output] == ["message"] and r.id.startswith("resp_")
    again = client.responses.create(**kw) if not stream else _streamed(client, **kw)[0]
    assert again.output_text == r.output_text  # its prompt's full pages now cached:
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached == (r.usage.input_tokens - 1) // 16 * 16 and cached > 0, again.usage


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_and_its_result_go_back_through_previous_response_id(served, client,
                                                                        stream):
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    kw = dict(model="default", input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
              temperature=1.0, max_output_tokens=400, extra_body={"seed": 5})
    r = _streamed(client, **kw)[0] if stream else client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and len(calls) == len(r.output)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": f"r{i}"}
               for i, c in enumerate(calls)]
    follow = dict(model="default", tools=TOOLS, max_output_tokens=6, temperature=0.0,
                  extra_body={"ignore_eos": True})
    after = client.responses.create(previous_response_id=r.id, input=results, **follow)
    # the conversation it continued is exactly the chat one, as the template renders it
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": c.call_id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
                *({"role": "tool", "tool_call_id": x["call_id"], "content": x["output"]}
                  for x in results)]
    import httpx2 as httpx
    want = httpx.post(served.url + "/tokenize", timeout=60, json={
        "model": "default", "messages": messages, "tools": CHAT_TOOLS}).json()["count"]
    assert after.usage.input_tokens == want and after.previous_response_id == r.id
    # the same items sent whole, with no stored response, are the same request
    items = [c.model_dump(exclude_none=True) for c in calls] + results
    again = client.responses.create(input=[{"role": "user", "content": "Weather in Oslo?"},
                                           *items], store=False, **follow)
    assert again.usage.input_tokens == want and again.output_text == after.output_text
    chat = client.chat.completions.create(model="default", messages=messages,
                                          tools=CHAT_TOOLS, max_tokens=6, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert after.output_text == (chat.choices[0].message.content or "")


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema_output_validates(client, stream):
    kw = dict(model="default", input="Who?", temperature=1.0, max_output_tokens=200,
              text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                               "strict": True}}, extra_body={"seed": 7})
    r = _streamed(client, **kw)[0] if stream else client.responses.create(**kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_stored_responses_are_retrieved_deleted_and_not_kept_when_asked(served, client):
    r = client.responses.create(model="default", input="Hi", max_output_tokens=3,
                                temperature=0.0)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id),
                 lambda: client.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input="Hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    kept_not = client.responses.create(model="default", input="Hi", max_output_tokens=3,
                                       temperature=0.0, store=False)
    assert kept_not.store is False and kept_not.output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_not.id)
    conftest.wait_blocks_free(served.url)

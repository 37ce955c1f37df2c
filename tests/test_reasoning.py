"""Reasoning output (``--reasoning-parser``): a reply split into reasoning and answer the same
whole and streamed in any pieces, each format's reading of constructed replies, and a real
``jserve serve`` of a transformers-written Qwen3 checkpoint (trained BPE, the think tags as
added tokens) asked through the official client, the split checked against the raw reply."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from jserve.serving.http_protocol import BadField, parse
from jserve.serving.reasoning import (
    FORMATS,
    ReasoningStream,
    prompt_leaves_open,
    split,
)

R1, QWEN3 = FORMATS["deepseek_r1"], FORMATS["qwen3"]


@pytest.mark.parametrize("fmt, text, thinking, want", [
    # deepseek_r1: the model thinks first, so a reply without a tag is reasoning.
    (R1, "a plan</think>\n\nthe answer", False, ("a plan", "\n\nthe answer")),
    (R1, "<think>a plan</think>answer", False, ("a plan", "answer")),
    (R1, "  <think>cut short", False, ("cut short", None)),
    (R1, "no tags at all", False, ("no tags at all", None)),
    (R1, "</think>only an answer", False, (None, "only an answer")),
    (R1, "", False, (None, None)),
    # qwen3: thinking can be off, so a reply that opens no block is the answer.
    (QWEN3, "just the answer", False, (None, "just the answer")),
    (QWEN3, "\n<think>\nsteps\n</think>\n\nanswer", False, ("\nsteps\n", "\n\nanswer")),
    (QWEN3, "<think>steps cut short", False, ("steps cut short", None)),
    (QWEN3, "answer with a </think> in it", False, (None, "answer with a </think> in it")),
    (QWEN3, "<thi", False, (None, "<thi")),  # a reply that ended inside a would-be tag
    (R1, "<thi", False, ("<thi", None)),
    # The prompt left a block open: the reply starts inside it, whatever the format.
    (QWEN3, "steps</think>answer</think>more", True, ("steps", "answer</think>more")),
    (QWEN3, "steps</thi", True, ("steps</thi", None)),
])
def test_each_format_reads_a_reply(fmt, text, thinking, want):
    assert split(fmt, text, thinking) == want


def test_an_open_block_is_read_from_the_prompts_end():
    assert prompt_leaves_open("<|im_start|>assistant\n<think>\n")
    assert not prompt_leaves_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_leaves_open("<|im_start|>assistant\n")
    assert prompt_leaves_open("</think> old turn <think>")


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<thi", "nk>", "k>", " ", "\n",
                           "a", "bc", "think", "/"])


@settings(max_examples=400, deadline=None)
@given(fmt=st.sampled_from([R1, QWEN3]), parts=st.lists(_PIECES, max_size=12),
       cuts=st.lists(st.integers(0, 60), max_size=6), thinking=st.booleans())
def test_a_reply_streamed_in_any_pieces_splits_as_it_does_whole(fmt, parts, cuts, thinking):
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    s = ReasoningStream(fmt, thinking)
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:]):
        r, c = s.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    reasoning, content = reasoning + r, content + c
    assert ((reasoning or None), (content or None)) == split(fmt, text, thinking)
    # Nothing is lost but the tags that delimit the reasoning.
    if reasoning:
        assert reasoning in text and content in text


def test_the_reasoning_fields_are_checked_only_with_a_parser():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    off = parse({**body, "include_reasoning": True}, "chat")
    assert off.reasoning is None
    with pytest.raises(BadField) as e:  # nothing can be dropped when nothing is split
        parse({**body, "include_reasoning": False}, "chat")
    assert e.value.field == "include_reasoning"
    on = parse({**body, "include_reasoning": False}, "chat", reasoning="qwen3")
    assert (on.reasoning, on.include_reasoning) == ("qwen3", False)
    assert parse({**body, "separate_reasoning": False}, "chat", reasoning="qwen3").reasoning \
        is None
    with pytest.raises(BadField) as e:
        parse({**body, "stream_reasoning": False}, "chat", reasoning="qwen3")
    assert e.value.field == "stream_reasoning"
    assert parse({"model": "m", "prompt": "hi"}, "completions",
                 reasoning="qwen3").reasoning is None  # completions are never split


def test_an_unknown_parser_is_refused_at_start(capsys):
    from jserve.cli import main
    with pytest.raises(SystemExit):
        main(["serve", "default", "--reasoning-parser", "granite"])
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "deepseek_r1, qwen3" in err


# -- served ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    from conftest import Served
    from hf_models import qwen3_thinking_dir
    s = Served(str(qwen3_thinking_dir()), "--served-model-name", "qwen3", "--reasoning-parser",
               "qwen3", "--max-model-len", "512", "--max-num-seqs", "8")
    yield s
    s.close()


@pytest.fixture(scope="module")
def tags():
    import transformers

    from hf_models import qwen3_thinking_dir
    tok = transformers.AutoTokenizer.from_pretrained(qwen3_thinking_dir())
    return {t: tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")}


def _chat(served, bodies: list[dict]) -> list[tuple]:
    """Each body's extra fields asked whole and streamed through the official client: the
    message's (reasoning, reasoning_content, content), the same put together from the
    chunks, and the message's extra field names."""
    import openai

    async def one(client, extra):
        extra = dict(extra)
        kw = dict(model="qwen3", messages=[{"role": "user", "content": "Add 2 and 2."}],
                  temperature=0, max_tokens=extra.pop("max_tokens", 10), extra_body=extra)
        whole = (await client.chat.completions.create(**kw)).choices[0].message
        parts = {"reasoning": "", "reasoning_content": "", "content": ""}
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            for k in parts:
                parts[k] += getattr(delta, k, None) or ""
        extra = whole.model_extra or {}
        got = (extra.get("reasoning"), extra.get("reasoning_content"), whole.content)
        return got, tuple(v or None for v in parts.values()), set(extra)

    async def main():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, b) for b in bodies))
    return asyncio.run(main())


OPEN = {"chat_template_kwargs": {"open_thinking": True}}
CLOSED = {"chat_template_kwargs": {"enable_thinking": False}}


def _in_open_block(text: str) -> tuple:
    before, tag, after = text.partition("</think>")
    return before or None, (after or None) if tag else None


@pytest.mark.slow
def test_served_replies_split_against_their_raw_text(served, tags):
    """Greedy replies of the real model, each asked also with ``separate_reasoning: false``
    (its raw text, all content): in a block the prompt left open, everything up to
    ``</think>`` is the reasoning; a prompt that closed the block, or opened none, gives all
    content; a reply that opens a block (forced by ``logit_bias``) is reasoning. The
    streamed chunks add up to the message, reasoning under both names (and neither when
    not split)."""
    think, end = ({"logit_bias": {str(tags[t]): 100}, "max_tokens": 3}
                  for t in ("<think>", "</think>"))
    cases = [  # (extra body fields, the (reasoning, content) of the raw text)
        (OPEN, _in_open_block),
        (CLOSED, lambda text: (None, text)),
        ({}, lambda text: (None, text)),
        ({**OPEN, **end}, lambda text: (None, text[len("</think>"):])),
        (think, lambda text: (text[len("<think>"):], None)),
    ]
    got = _chat(served, [extra for extra, _ in cases])
    raws = _chat(served, [{**extra, "separate_reasoning": False} for extra, _ in cases])
    assert raws[3][0][2] == "</think>" * 3 and raws[4][0][2] == "<think>" * 3  # forced
    assert raws[0][0][2] and "</think>" not in raws[0][0][2]  # the model's own words
    for (extra, want), (whole, streamed, names), (raw, _, raw_names) in zip(cases, got, raws):
        assert raw[:2] == (None, None) and raw[2], extra
        reasoning, content = want(raw[2])
        assert whole == (reasoning, reasoning, content), extra
        assert streamed == whole, extra
        assert names == {"reasoning", "reasoning_content"}
        assert raw_names == set()  # not split: not there


@pytest.mark.slow
def test_a_constrained_reply_thinks_first_and_answers_in_its_grammar(served, tags):
    """A guided choice in a block the prompt left open: the reply is free up to ``</think>``
    (the random model thinks until max_tokens), then held to the choice; forced to end its
    block at once (``logit_bias``), it answers one of the choices and stops."""
    choice = {"guided_choice": ["yes", "no"]}
    forced = {"logit_bias": {str(tags["</think>"]): 100}}
    (free, free_streamed, _), (ended, ended_streamed, _) = _chat(
        served, [{**OPEN, **choice, "max_tokens": 12}, {**OPEN, **choice, **forced}])
    assert free == free_streamed and ended == ended_streamed
    assert free[0] and free[2] is None  # thought to max_tokens, in no grammar
    assert ended[:2] == (None, None) and ended[2].lstrip("\n") in ("yes", "no")


def test_a_constraint_holds_after_the_thinking_block_the_format_allows():
    """The grammar of a structured output behind each kind of block, on the Qwen3
    checkpoint's tokenizer (the tags its tokens): free text up to the end tag, at most two
    newlines, then the constraint; an output it refuses is refused where it goes wrong."""
    from hf_models import qwen3_thinking_dir
    from jserve.sampling.structured import GrammarCompiler, StructuredOutput
    from jserve.tokenizer import load_tokenizer
    tok = load_tokenizer(qwen3_thinking_dir())
    compiler = GrammarCompiler(tok, 1216, tuple(tok.eos_token_ids))

    def verdict(so, text):
        c = compiler.compile(so)
        for t in tok.encode(text, add_special_tokens=False):
            if not c.advance(t):
                return "refused"
        return "done" if c.done else "open"
    yes_no = lambda mode: StructuredOutput(choice=["yes", "no"], think=mode)  # noqa: E731
    schema = StructuredOutput(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]}, think="first")
    cases = [(yes_no("open"), "x</think>yes", "done"), (yes_no("open"), "x</think>\n\nno", "done"),
             (yes_no("open"), "yes", "open"),  # still thinking: "yes" is a thought
             (yes_no("open"), "x</think>\n\n\nno", "refused"),
             (yes_no("open"), "x</think>maybe", "refused"),
             (yes_no("first"), "<think>x</think>no", "done"),
             (yes_no("first"), "x</think>no", "done"),
             (yes_no("optional"), "<think>\nx\n</think>\n\nno", "done"),
             (yes_no("optional"), "no", "done"), (yes_no("optional"), "x</think>no", "refused"),
             (schema, '<think>hm</think>\n\n{"a":4}', "done"),
             (schema, '<think>hm</think>{ "a":4}', "refused"),  # compact JSON, as without
             (StructuredOutput(grammar='start: "A" | "B"', think="optional"), "B", "done")]
    assert [verdict(so, text) for so, text, _ in cases] == [want for _, _, want in cases]
    with pytest.raises(ValueError, match="think"):
        StructuredOutput(regex="a", think="later")


def test_a_constraint_holds_after_a_block_whose_tags_are_text():
    """Where the tags are no tokens of the vocabulary (the byte tokenizer; the Hermes
    checkpoint, whose own tokens are the <tool_call> tags), the free text is a lazy rule
    that ends at the first ``</think>`` text, however it is cut into tokens; a forced
    Hermes call follows its block as it would alone."""
    import dataclasses

    from hf_models import hermes_chat_dir
    from jserve.sampling.structured import GrammarCompiler, StructuredOutput
    from jserve.serving.tool_calls import parse_tools
    from jserve.serving.tool_formats import constraint
    from jserve.tokenizer import ByteTokenizer, load_tokenizer

    def verdict(compiler, tok, so, text):
        c = compiler.compile(so)
        for t in tok.encode(text, add_special_tokens=False):
            if not c.advance(t):
                return "refused"
        return "done" if c.done else "open"
    byte = ByteTokenizer()
    compiler = GrammarCompiler(byte, 320, tuple(byte.eos_token_ids))
    yes_no = lambda mode: StructuredOutput(choice=["yes", "no"], think=mode)  # noqa: E731
    cases = [("optional", "<think>a </thi b</think>\n\nno", "done"),
             ("optional", "no", "done"), ("optional", "x</think>no", "refused"),
             ("first", "a</think>yes", "done"), ("open", "a < / b</think>yes", "done"),
             ("open", "a</think>maybe", "refused")]
    assert [verdict(compiler, byte, yes_no(m), t) for m, t, _ in cases] == \
        [want for _, _, want in cases]
    tok = load_tokenizer(hermes_chat_dir())
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    forced = constraint(*parse_tools({"tools": tools, "tool_choice": "required"}, "hermes"),
                        tok)
    call = '<tool_call>\n{"name":"get_time","arguments":{"city":"Oslo"}}\n</tool_call>'
    hermes = GrammarCompiler(tok, 1280, tuple(tok.eos_token_ids))
    assert verdict(hermes, tok, dataclasses.replace(forced, think="first"),
                   "<think>Oslo</think>\n" + call) == verdict(hermes, tok, forced, call) == "open"
    assert verdict(hermes, tok, dataclasses.replace(forced, think="first"),
                   "<think>Oslo</think>\nno call") == "refused"


def test_reasoning_can_be_dropped_and_must_stream(served):
    import openai
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) as client:
        kw = dict(model="qwen3", messages=[{"role": "user", "content": "Add 2 and 2."}],
                  temperature=0, max_tokens=6)
        kept = client.chat.completions.create(**kw, extra_body=OPEN).choices[0].message
        dropped = client.chat.completions.create(
            **kw, extra_body={**OPEN, "include_reasoning": False}).choices[0].message
        assert kept.model_extra["reasoning"] and kept.content is None
        assert "reasoning" not in (dropped.model_extra or {}) and dropped.content is None
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, extra_body={"stream_reasoning": False})
        assert "stream_reasoning" in str(e.value)


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_splits_its_reasoning_as_the_chat_reply_does(served, stream):
    """The Responses API on the same parser: a reply in an open block is a reasoning item
    (its text the chat message's reasoning) and an empty message; a closed block, all
    message. Streamed, the reasoning deltas add up to the item."""
    import openai
    with openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0,
                       timeout=300) as client:
        for extra in (OPEN, CLOSED):
            m = client.chat.completions.create(
                model="qwen3", messages=[{"role": "user", "content": "Add 2 and 2."}],
                temperature=0, max_tokens=10, extra_body=extra).choices[0].message
            kw = dict(model="qwen3", input="Add 2 and 2.", temperature=0,
                      max_output_tokens=10, extra_body=extra)
            if stream:
                events = list(client.responses.create(stream=True, **kw))
                r = events[-1].response
                thought = "".join(e.delta for e in events
                                  if e.type == "response.reasoning_text.delta")
                assert thought == "".join(o.content[0].text for o in r.output
                                          if o.type == "reasoning")
            else:
                r = client.responses.create(**kw)
            reasoning = [o.content[0].text for o in r.output if o.type == "reasoning"]
            assert (reasoning or [None]) == [m.model_extra["reasoning"]], extra
            assert r.output_text == (m.content or "") and r.output[-1].type == "message"


def test_a_thinking_reply_that_calls_tools_reads_the_same_whole_and_streamed():
    """Reasoning first, then the calls read from the answer alone (Hermes blocks): the whole
    message and 5-character chunks give the same reasoning, content and calls."""
    from hf_models import qwen3_thinking_dir
    from jserve.serving import engine_api as el
    from jserve.serving.http_responses import Choice, Formatter, apply_deltas
    from jserve.tokenizer import load_tokenizer
    tok = load_tokenizer(qwen3_thinking_dir())
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    parsed = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "tools": tools}, "chat", tool_format="hermes", tokenizer=tok,
                   reasoning="qwen3")
    text = ('<think>Oslo, so call it.</think>\n\n<tool_call>\n{"name": "get_time", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>')
    prompt = tok.encode("<|im_start|>assistant\n")
    whole = Formatter("chat", "r", "m", tok, parsed).full(
        [Choice(0, None, text=text, finish_reason="stop", prompt_ids=prompt)])["choices"][0]
    message = whole["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (
        "Oslo, so call it.", "Oslo, so call it.", "\n\n")
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == [("get_time", '{"city": "Oslo"}')]
    assert whole["finish_reason"] == "tool_calls"
    fmt, c = Formatter("chat", "r", "m", tok, parsed), Choice(0, None, prompt_ids=prompt)
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    reasoning = content = arguments = ""
    for k, piece in enumerate(pieces):
        d = el.Delta([1], piece, [], finish_reason="stop" if k == len(pieces) - 1 else None)
        apply_deltas(c, [d])
        item = fmt.chunk(c, [d], k == 0)["choices"][0]
        reasoning += item["delta"].get("reasoning") or ""
        content += item["delta"].get("content") or ""
        arguments += "".join(t["function"].get("arguments") or ""
                             for t in item["delta"].get("tool_calls", []))
    assert (reasoning, content, arguments, item["finish_reason"]) == (
        "Oslo, so call it.", "\n\n", '{"city": "Oslo"}', "tool_calls")

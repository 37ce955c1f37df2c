"""gpt-oss's harmony output (vLLM's ``--reasoning-parser openai_gptoss`` and
``--tool-call-parser openai``). A reply is a run of messages, each a header and a body::

    [<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY<|end|>

The generation prompt ends with ``<|start|>assistant``, so the reply's first header starts at
``<|channel|>``; its last message ends at a stop token instead (``<|return|>``, or ``<|call|>``
after a call), which is never in the text. The ``analysis`` channel is the reasoning,
``final`` the answer; ``commentary`` without a recipient is a preamble the user may see
(content too); a message to a recipient (``to=functions.NAME``) is a tool call, its body
the arguments. The markers are special tokens, so the server decodes these replies with
``skip_special_tokens`` false (``ReasoningFormat.keeps_special_tokens``).

``HarmonyStream`` is the reasoning side (``reasoning.ReasoningStream``'s interface): the
analysis bodies as reasoning, the other bodies as content, and a call kept as one
``<|channel|>commentary to=RECIPIENT<|message|>ARGUMENTS`` piece of the content, which
``HarmonyCallParser`` (the ``openai`` tool format) reads into OpenAI's ``tool_calls``. A reply
that does not start with a header (a structured output holds it from its first token) is
content whole. Either holds back only what could still be a marker. No engine state, no JAX.
"""
from __future__ import annotations

import json
import re

from jserve.sampling.structured import StructuredOutput, lark_literal, text_until
from jserve.serving.tool_calls import (
    ToolCallParser,
    ToolChoice,
    call_schemas,
    forced_tools,
    partial_mark,
)

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CONSTRAIN = "<|constrain|>"
_RECIPIENT = re.compile(r"\bto=(\S+)")
_HEADS = (START, CHANNEL)
_BODY_ENDS = (END, START)


def _hold(text: str, marks: tuple[str, ...]) -> tuple[str, str]:
    """``text`` as (what may go out now, what is held back: a mark may be arriving)."""
    keep = partial_mark(text, marks)
    return text[:len(text) - keep], text[len(text) - keep:]


def _first(text: str, marks: tuple[str, ...]) -> tuple[int, str]:
    """Where the earliest of ``marks`` starts in ``text`` (-1 if none), and which."""
    hits = [(i, m) for m in marks if (i := text.find(m)) != -1]
    return min(hits) if hits else (-1, "")


def route(header: str) -> tuple[str, str | None]:
    """A header (between a message's start and ``<|message|>``) as (where its body goes:
    reasoning | content | call, the recipient)."""
    m = _RECIPIENT.search(header)
    if m is not None:
        return "call", m.group(1).split("<|")[0]
    channel = header.rsplit(CHANNEL, 1)[-1].replace(CONSTRAIN, " ").split()
    return ("reasoning" if channel[:1] == ["analysis"] else "content"), None


class HarmonyStream:
    """One reply read piece by piece: ``feed`` returns the (reasoning, content) text each
    piece adds, ``finish`` what was held back; the pieces add up to the whole reply's."""

    def __init__(self):
        self._phase = "start"    # start | header | body | plain
        self._route = "content"  # where the body in progress goes
        self._header = ""
        self._held = ""

    @property
    def answering(self) -> bool:
        """Only a reply with no header settles into plain content; a harmony reply may
        open another message, so each of its chunks is read."""
        return self._phase == "plain"

    def feed(self, text: str) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        out = {"reasoning": "", "content": ""}
        while text:
            if self._phase == "start":
                lead = text.lstrip()
                if lead.startswith(_HEADS):
                    self._phase = "header"
                elif any(m.startswith(lead) for m in _HEADS):  # nothing yet, or a marker
                    self._held = text
                    break
                else:
                    self._phase = "plain"
            if self._phase == "plain":
                out["content"] += text
                break
            if self._phase == "header":
                text, self._header = self._header + text, ""
                i = text.find(MESSAGE)
                if i == -1:
                    self._header = text
                    break
                header, text = text[:i], text[i + len(MESSAGE):]
                self._route, recipient = route(header)
                self._phase = "body"
                if recipient is not None:
                    out["content"] += f"{CHANNEL}commentary to={recipient}{MESSAGE}"
                continue
            i, mark = _first(text, _BODY_ENDS)
            body = "reasoning" if self._route == "reasoning" else "content"
            if i == -1:
                piece, self._held = _hold(text, _BODY_ENDS)
                out[body] += piece
                break
            out[body] += text[:i]
            if self._route == "call":
                out["content"] += END  # (the call's end, for its reader)
            self._phase = "header"
            text = text[i + (len(END) if mark == END else 0):]
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str]:
        """What was held back (the reply ended; a header cut short says nothing)."""
        held, self._held = self._held, ""
        if self._phase == "header":
            return "", ""
        if self._phase == "body" and self._route == "reasoning":
            return held, ""
        return "", held


class HarmonyCallParser(ToolCallParser):
    """The ``openai`` tool format's reader of the content ``HarmonyStream`` gives: a
    ``<|channel|>commentary to=functions.NAME<|message|>`` piece opens a call of NAME and
    what follows, to ``<|end|>`` or the reply's end, is its arguments as they stream; the
    rest is content."""

    _OPEN = f"{CHANNEL}commentary to="

    def __init__(self, choice: ToolChoice):
        super().__init__(choice)
        self._phase = "content"  # content | name | args
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        text, self._held = self._held + text, ""
        content, deltas = "", []
        while text:
            if self._phase == "content":
                i = text.find(self._OPEN)
                if i == -1:
                    piece, self._held = _hold(text, (self._OPEN,))
                    content += piece
                    break
                content, text, self._phase = content + text[:i], text[i + len(self._OPEN):], \
                    "name"
            elif self._phase == "name":
                i = text.find(MESSAGE)
                if i == -1:
                    self._held = text
                    break
                self._open_call(text[:i].removeprefix("functions."), deltas)
                text, self._phase = text[i + len(MESSAGE):], "args"
            else:
                i = text.find(END)
                if i == -1:
                    piece, self._held = _hold(text, (END,))
                    self._arguments(piece, deltas)
                    break
                self._arguments(text[:i], deltas)
                text, self._phase = text[i + len(END):], "content"
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        held, self._held = self._held, ""
        deltas: list[dict] = []
        if self._phase == "args":
            self._arguments(held, deltas)
            return "", deltas
        return (held if self._phase == "content" else ""), deltas


def harmony_constraint(tools: list[dict], choice: ToolChoice, tokenizer=None
                       ) -> StructuredOutput | None:
    """The grammar of ``required`` and of a named function: at most one analysis message
    (its body any text), then a call, ``<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>`` and the arguments held to that tool's
    parameters (compact JSON); the call token after them ends the reply. Harmony has one call
    a message and the reply ends at it, so ``parallel_tool_calls`` makes no second one.
    None for ``auto`` and ``none``. The markers as ``tokenizer`` has them (one token each)."""
    given = forced_tools(tools, choice)
    if given is None:
        return None
    mark = lambda text: lark_literal(tokenizer, text)  # noqa: E731
    calls = []
    for call in call_schemas(given):
        name = call["properties"]["name"]["const"]
        schema = {**call["properties"]["arguments"], "x-guidance": {"whitespace_flexible": False}}
        calls.append(f'{mark(CHANNEL)} {json.dumps(f"commentary to=functions.{name} ")} '
                     f'{mark(CONSTRAIN)} "json" {mark(MESSAGE)} %json {json.dumps(schema)}')
    body, thought = text_until(mark(END))
    rules = [f'analysis: {mark(CHANNEL)} "analysis" {mark(MESSAGE)} {body} {mark(START)} '
             f'"assistant"', thought,
             "call: " + " | ".join(f"call{j}" for j in range(len(calls))),
             *(f"call{j}: {c}" for j, c in enumerate(calls))]
    return StructuredOutput(grammar="%llguidance {}\nstart: analysis? call\n"
                                    + "\n".join(rules) + "\n")
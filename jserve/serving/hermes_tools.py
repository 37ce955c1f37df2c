"""The Hermes tool-call format (vLLM's ``--tool-call-parser hermes``: Qwen2.5 and Qwen3,
Hermes 2 Pro and 3, and other models trained on it). The chat template tells the model to
answer each call as a block of its own::

    <tool_call>
    {"name": <function>, "arguments": <arguments>}
    </tool_call>

one block per call, one after another, after some content text or none. How an output is
read (vLLM's reading, except where said):

- the text before the first ``<tool_call>`` is the message's content, exactly as written;
- each block is one call. Its object names the function first (as the models write it) or
  not: a name-first call streams as it comes (id and name, then the arguments in pieces), one
  in another key order goes out whole once its block closes. ``"parameters"`` is read as
  ``"arguments"``. The last block still counts without its ``</tool_call>`` if its object is
  whole (an output cut there);
- text after the calls that is not another block is content too (vLLM drops it);
- a block that holds no such object, or in ``auto`` a call whose arguments do not parse, makes
  the whole output content (a stream can say so only from that block on);
- the name is read as written, one of ``tools`` or not (vLLM does the same); under
  ``required`` and a named choice the grammar allows only the given functions.

``tool_choice: required`` holds the output to one or more blocks (exactly one with
``parallel_tool_calls: false``) separated by a newline, each object ``{"name": <a tool>,
"arguments": <its parameters' schema>}`` in compact JSON; a named choice to one block of that
function. No engine state, no JAX.
"""
from __future__ import annotations

import json

from jserve.sampling.structured import StructuredOutput, lark_literal
from jserve.serving.tool_calls import (
    PARTIAL,
    WS,
    ToolCallParser,
    ToolChoice,
    any_of,
    call_header,
    call_schemas,
    forced_tools,
    partial_mark,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def hermes_constraint(tools: list[dict], choice: ToolChoice, tokenizer=None
                      ) -> StructuredOutput | None:
    """The grammar of ``required`` and of a named function (a Lark grammar for llguidance,
    each block's object an inline JSON schema; the tags as ``tokenizer`` has them: one token
    each, or text); None for ``auto`` and ``none``."""
    given = forced_tools(tools, choice)
    if given is None:
        return None
    one = choice.mode == "named" or not choice.parallel
    calls = call_schemas(given)
    schema = any_of(calls)
    # Compact JSON, as the other constraints (structured.py): no padding with whitespace.
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    gap = json.dumps("\n")
    head = f"{lark_literal(tokenizer, OPEN)} {gap}"
    tail = f"{gap} {lark_literal(tokenizer, CLOSE)}"
    start = "start: call" if one else f"start: call ({gap} call)*"
    return StructuredOutput(grammar=f"%llguidance {{}}\n{start}\n"
                                    f"call: {head} %json {json.dumps(schema)} {tail}\n")


def _whole_call(body: str) -> tuple[str, str] | None:
    """A block's text read as one call at once: (name, arguments as JSON), None if it is
    not ``{"name": <string>, "arguments": <object>}`` (any key order)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = set(obj) - {"name"}
    if len(keys) != 1 or not keys <= {"arguments", "parameters"}:
        return None
    arguments = obj[keys.pop()]
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesCallParser(ToolCallParser):
    """``ToolCallParser`` (its calls, deltas and argument scanning) for ``<tool_call>``
    blocks: ``feed(text)`` and ``finish()`` return (content, tool-call deltas) as the llama3
    reader does; ``malformed`` says a block was not a call."""

    def __init__(self, choice: ToolChoice):
        super().__init__(choice)
        # text | open | args | close | end | whole | between | content
        self._state = "text"
        self._opened = False  # the block being read has sent its call
        self.malformed = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._text += text
        if self.choice.mode == "none":
            return text, []
        content, deltas = "", []
        t = self._text
        while self._at < len(t):
            piece = getattr(self, "_read_" + self._state)(t, deltas)
            if piece is None:  # wait for more text
                break
            content += piece
        return content, deltas

    def _begin(self, at: int) -> None:
        self._mark, self._at, self._state, self._opened = at, at + len(OPEN), "open", False

    def _bad(self, t: str) -> str:
        """Not a call after all: the rest of the output is content (from the block's tag,
        unless the block's call went out already)."""
        self.malformed = True
        start = self._at if self._opened else self._mark
        self._state, self._at = "content", len(t)
        return t[start:]

    def _read_text(self, t: str, deltas: list[dict]) -> str | None:
        k = t.find(OPEN, self._at)
        if k >= 0:
            piece = t[self._at:k]
            self._begin(k)
            return piece
        end = len(t) - partial_mark(t[self._at:], (OPEN,))
        if end == self._at:
            return None
        piece, self._at = t[self._at:end], end
        return piece

    def _read_open(self, t: str, deltas: list[dict]) -> str | None:
        h = call_header(t, self._at)
        if h is PARTIAL:
            return None
        if h is None or t[h[0]] != "{":  # another key order, or not a call: read it whole
            self._state = "whole"
            return ""
        end, name = h
        self._open_call(name, deltas)
        self._opened, self._at, self._state, self._depth = True, end, "args", 0
        return ""

    def _read_args(self, t: str, deltas: list[dict]) -> str:
        j = self._scan_arguments(t, self._at)  # the state becomes "close" at their end
        self._arguments(t[self._at:j], deltas)
        self._at = j
        return ""

    def _read_close(self, t: str, deltas: list[dict]) -> str:  # the object's own '}'
        if t[self._at] in WS:
            self._at += 1
        elif t[self._at] == "}":
            self._at += 1
            self._state = "end"
        else:
            return self._bad(t)
        return ""

    def _read_end(self, t: str, deltas: list[dict]) -> str | None:  # then </tool_call>
        if t[self._at] in WS:
            self._at += 1
        elif t.startswith(CLOSE, self._at):
            self._at += len(CLOSE)
            self._state = "between"
        elif CLOSE.startswith(t[self._at:]):
            return None
        else:
            return self._bad(t)
        return ""

    def _read_whole(self, t: str, deltas: list[dict]) -> str | None:
        k = t.find(CLOSE, self._at)
        if k < 0:
            return None
        if not self._send_whole(t[self._at:k], deltas):
            return self._bad(t)
        self._at, self._state = k + len(CLOSE), "between"
        return ""

    def _send_whole(self, body: str, deltas: list[dict]) -> bool:
        call = _whole_call(body)
        if call is None:
            return False
        self._open_call(call[0], deltas)
        self._arguments(call[1], deltas)
        return True

    def _read_between(self, t: str, deltas: list[dict]) -> str | None:
        if t[self._at] in WS:
            self._at += 1
        elif t.startswith(OPEN, self._at):
            self._begin(self._at)
        elif OPEN.startswith(t[self._at:]):
            return None
        else:  # text after the calls
            self._state = "text"
        return ""

    def _read_content(self, t: str, deltas: list[dict]) -> str:
        piece, self._at = t[self._at:], len(t)
        return piece

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the output: a held-back tail that never became a tag is content; a
        last block without ``</tool_call>`` is a call if its object is whole."""
        t, deltas = self._text, []
        if self.choice.mode == "none":
            return "", []
        if self._state in ("text", "between"):
            rest, self._at = t[self._at:], len(t)
            return rest, []
        if self._state == "whole":
            if self._send_whole(t[self._at:], deltas):
                self._at = len(t)
                return "", deltas
            return self._bad(t), []
        if self._state == "open":
            return self._bad(t), []
        if self._state in ("args", "close"):  # cut inside the object: the call is out
            self.malformed = True
        return "", []

    def well_formed(self) -> bool:
        return not self.malformed and super().well_formed()

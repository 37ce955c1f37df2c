"""OpenAI tool calling on the chat endpoint: the ``tools`` and ``tool_choice`` a request may
give, the constraint they put on the output, and the reading of the output back into
``tool_calls`` (docs/structured_output.md, "Tool calling").

The format the model writes calls in is the server's choice (``--tool-call-parser``;
``jserve.serving.tool_formats`` holds the formats, ``hermes_tools`` the Hermes one). This
module is the request side and the default format, Llama 3.1's JSON, ``{"name": <function>,
"parameters": <arguments>}`` (several separated by ``;``), which the chat templates ask for
(the built-in models' template too, ``jserve.tokenizer.simple_chat_prompt``). ``tool_choice``:

- ``auto`` (the default with tools): unconstrained; an output that starts with such an object
  is read as calls, any other output is the message's content;
- ``required``: constrained to a JSON array of one or more ``{"name", "parameters"}`` objects,
  each held to its function's parameter schema (one at most with ``parallel_tool_calls:
  false``), as vLLM does;
- a named function: constrained to that function's parameter schema; the whole output is its
  arguments;
- ``none``: the tools stay in the prompt, the output is content.

``ToolCallParser`` reads the text as it streams, so a stream carries OpenAI's tool-call deltas
(the call's id and name first, then its arguments in pieces) as the tokens come. No engine
state, no JAX.
"""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from jserve import fields
from jserve.sampling.structured import StructuredOutput, ascii_schema

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolError(ValueError):
    """A bad ``tools``/``tool_choice``/``parallel_tool_calls``: ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """What a request's tools may do: ``mode`` none | auto | required | named (``name``);
    ``format``: the tool-call format the output is read in (``tool_formats.TOOL_FORMATS``)."""

    mode: str
    name: str | None = None
    parallel: bool = True
    format: str = "llama3_json"

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls."""
        return self.mode != "none"


def parse_tools(body: dict, fmt: str = "llama3_json"
                ) -> tuple[list[dict] | None, ToolChoice | None]:
    """A chat body's ``tools`` (checked, as given) and ``tool_choice``, its calls read in
    format ``fmt``; ``ToolError`` naming the field otherwise. No tools: (None, None)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"parallel_tool_calls must be a bool, got "
                                               f"{parallel!r}")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None, None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools", "tools must be a non-empty list of functions")
    names: list[str] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not (isinstance(t, dict) and t.get("type") == "function" and set(t) <= _TOOL_KEYS
                and isinstance(t.get("function"), dict)):
            raise ToolError(where, f"{where} must be {{\"type\": \"function\", \"function\": "
                                   f"{{...}}}}, got {t!r}")
        f = t["function"]
        extra = sorted(set(f) - _FUNCTION_KEYS)
        if extra:
            raise ToolError(f"{where}.function.{extra[0]}",
                            f"{where}.function.{extra[0]} is not supported by jserve")
        name = f.get("name")
        if not (isinstance(name, str) and _FUNCTION_NAME.fullmatch(name)):
            raise ToolError(f"{where}.function.name", f"{where}.function.name must be 1 to 64 "
                            f"letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise ToolError(f"{where}.function.name", f"{where}.function.name {name!r} is "
                                                      f"given twice")
        if not isinstance(f.get("parameters", {}), dict):
            raise ToolError(f"{where}.function.parameters",
                            f"{where}.function.parameters must be a JSON schema object")
        if not isinstance(f.get("description", ""), str):
            raise ToolError(f"{where}.function.description",
                            f"{where}.function.description must be a string")
        names.append(name)
    if choice is None or choice in ("none", "auto", "required"):
        return tools, ToolChoice(choice or "auto", parallel=parallel, format=fmt)
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {
            "type", "function"} and isinstance(choice["function"], dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise ToolError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or "
                                       f"{{\"type\": \"function\", \"function\": {{\"name\": "
                                       f"...}}}}, got {choice!r}")
    if name not in names:
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not in tools "
                                       f"({', '.join(names)})")
    return tools, ToolChoice("named", name, parallel, fmt)


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object"}


def tool_constraint(tools: list[dict], choice: ToolChoice) -> StructuredOutput | None:
    """The output constraint of ``required`` and of a named function; None otherwise."""
    given = forced_tools(tools, choice)
    if given is None:
        return None
    if choice.mode == "named":
        return StructuredOutput(json=_parameters(given[0][1]))
    calls = [{"type": "object", "additionalProperties": False,
              "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": _parameters(t)}} for _, t in given]
    return StructuredOutput(json=call_array(calls, choice.parallel))


def any_of(schemas: list[dict]) -> dict:
    """One of ``schemas`` (the schema itself when it is the only one)."""
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def call_array(calls: list[dict], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more of the ``calls`` schemas (one with ``parallel`` off)."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": any_of(calls)}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_tools(tools: list[dict], choice: ToolChoice) -> list[tuple[int, dict]] | None:
    """The ``(index, tool)`` pairs a reply must call one of: the named function's, or every
    tool's under ``required``; None when the choice forces no call (``auto``, ``none``)."""
    if choice.mode == "named":
        return [(i, t) for i, t in enumerate(tools) if t["function"]["name"] == choice.name]
    if choice.mode == "required":
        return list(enumerate(tools))
    return None


def call_schemas(given: list[tuple[int, dict]]) -> list[dict]:
    """The JSON schema of a call of each ``(index, tool)``: ``{"name": <its name>,
    "arguments": <its parameters>}`` (\\d, \\w, \\s as ASCII classes, for a grammar that
    embeds the schema); ``ToolError`` naming a tool whose parameters hold a bad pattern."""
    calls = []
    for i, t in given:
        try:
            arguments = ascii_schema(_parameters(t))
        except ValueError as e:
            raise ToolError(f"tools[{i}].function.parameters", str(e)) from None
        calls.append({"type": "object", "additionalProperties": False,
                      "required": ["name", "arguments"],
                      "properties": {"name": {"const": t["function"]["name"]},
                                     "arguments": arguments}})
    return calls


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them (transformers' convention): an assistant's
    ``tool_calls`` carry their arguments as objects, not the JSON strings of the API."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"],
                                   "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]]}
        out.append(m)
    return out


def check_tool_calls(where: str, calls: Any) -> list[dict]:
    """An assistant message's ``tool_calls`` (as the API writes them), checked; ``ToolError``
    naming the first bad part."""
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"{where}.tool_calls", f"{where}.tool_calls must be a non-empty list")
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and c.get("type", "function") == "function"
                and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise ToolError(at, f"{at} must be {{\"id\", \"type\": \"function\", \"function\": "
                                f"{{\"name\", \"arguments\"}}}}, got {c!r}")
        try:
            fields.loads(f["arguments"], f"{at}.function.arguments")
        except ValueError as e:
            raise ToolError(f"{at}.function.arguments", str(e)) from None
    return calls


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- reading calls out of the text ---------------------------------------------------------
WS = " \t\r\n"


def partial_mark(text: str, marks: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``marks``: what a
    streaming reader (tool formats, reasoning) holds back, since a mark may be arriving."""
    for n in range(min(max(map(len, marks)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in marks):
            return n
    return 0
PARTIAL = object()  # not decided yet: more text may complete it


def call_header(text: str, i: int):
    """``{"name": "<f>", "parameters": `` (or ``"arguments"``) at ``text[i:]``: (end, name),
    ``PARTIAL`` if the text so far could still become one, None if it cannot."""
    pieces = ("{", '"name"', ":", None, ",", ('"parameters"', '"arguments"'), ":")
    name = None
    for piece in pieces:
        while i < len(text) and text[i] in WS:
            i += 1
        if i == len(text):
            return PARTIAL
        if piece is None:  # the name: a JSON string
            m = re.compile(r'"((?:[^"\\]|\\.)*)"').match(text, i)
            if m is None:
                return PARTIAL if text[i] == '"' else None
            try:
                name = json.loads(m.group(0))
            except ValueError:
                return None
            i = m.end()
            continue
        options = piece if isinstance(piece, tuple) else (piece,)
        for lit in options:
            if text.startswith(lit, i):
                i += len(lit)
                break
        else:
            rest = text[i:]
            return PARTIAL if any(lit.startswith(rest) for lit in options) else None
    while i < len(text) and text[i] in WS:
        i += 1
    return (i, name) if i < len(text) else PARTIAL


class ToolCallParser:
    """One choice's output read as it streams: ``feed(text)`` and, at the end, ``finish()``
    each return (content, tool-call deltas) in OpenAI's streaming form (a call's first delta
    has its index, id, type and name with empty arguments; later ones add argument text).
    The calls' full form is ``calls``."""

    new_id = staticmethod(new_call_id)  # a call's id (a format may want its own shape)

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.calls: list[dict] = []   # {"id", "type", "function": {"name", "arguments"}}
        self._text = ""
        self._at = 0                  # how far the text is read
        self._mark = 0                # where text not yet known to be content or a call starts
        self._state = "start"         # start | between | header | args | close | content
        self._depth = 0               # inside the arguments: brackets open
        self._in_string = self._escape = False
        self._array = choice.mode == "required"

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _open_call(self, name: str, deltas: list[dict]) -> None:
        call = {"id": self.new_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}
        deltas.append({"index": len(self.calls), "id": call["id"], "type": "function",
                       "function": {"name": name, "arguments": ""}})
        self.calls.append(call)

    def _arguments(self, piece: str, deltas: list[dict]) -> None:
        if not piece or not self.calls:
            return
        self.calls[-1]["function"]["arguments"] += piece
        index = len(self.calls) - 1
        if deltas and deltas[-1]["index"] == index:
            deltas[-1]["function"]["arguments"] += piece
        else:
            deltas.append({"index": index, "function": {"arguments": piece}})

    def _scan_arguments(self, t: str, i: int) -> int:
        """Reads a call's arguments from ``t[i]`` on (strings, escapes, brackets); where
        they end (the state is then ``close``), or ``len(t)`` if they go on."""
        j = i
        while j < len(t):
            ch = t[j]
            j += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "close"
                    return j
        return j

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._text += text
        content, deltas = "", []
        if self.choice.mode == "named":
            if not self.calls:
                self._open_call(self.choice.name, deltas)
            self._arguments(text, deltas)
            return "", deltas
        if self.choice.mode == "none":
            return text, []
        t = self._text
        while self._at < len(t):
            i = self._at
            if self._state == "content":
                content += t[i:]
                self._at = len(t)
            elif self._state == "start":  # auto: a call starts with '{' (or '[')
                stripped = t[i:].lstrip(WS)
                if not stripped:
                    break
                self._mark = len(t) - len(stripped)
                if stripped[0] == "[":
                    self._array = True
                    self._at = self._mark + 1
                    self._state = "header"
                elif stripped[0] == "{":
                    self._state = "header"
                else:
                    self._state = "content"
            elif self._state == "between":  # after a call: a separator, or the end
                if t[i] in WS or t[i] in ",;]":
                    self._at += 1
                elif t[i] == "{":
                    self._state = "header"
                    self._mark = i
                else:
                    self._state = "content"
            elif self._state == "header":
                h = call_header(t, i)
                if h is PARTIAL:
                    break
                if h is None or t[h[0]] != "{":  # not a call after all: all of it is content
                    self._state = "content"
                    self._at = self._mark
                    continue
                end, name = h
                self._open_call(name, deltas)
                self._at = end
                self._state = "args"
                self._depth = 0
            elif self._state == "args":
                j = self._scan_arguments(t, i)
                self._arguments(t[i:j], deltas)
                self._at = j
            elif self._state == "close":  # the call object's own '}'
                if t[i] in WS:
                    self._at += 1
                elif t[i] == "}":
                    self._at += 1
                    self._state = "between"
                else:
                    self._state = "content"
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end: text held back while it could still have become a call
        is content after all."""
        if self.choice.mode in ("named", "none") or self._state not in ("start", "header"):
            return "", []
        rest = self._text[self._mark if self._state == "header" else self._at:]
        self._at = len(self._text)
        return rest, []

    def well_formed(self) -> bool:
        """Every call's arguments parse as JSON (the unconstrained ``auto`` output may not)."""
        for call in self.calls:
            try:
                fields.loads(call["function"]["arguments"], "arguments")
            except ValueError:
                return False
        return True


def read_tool_calls(choice: ToolChoice, text: str, parser_type: type = ToolCallParser
                    ) -> tuple[str | None, list[dict]]:
    """A whole output as (content, calls), read by the streaming reader ``parser_type`` (so
    a stream's deltas add up to the same): an ``auto`` output whose calls do not parse is
    content."""
    parser = parser_type(choice)
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    content += rest
    if parser.calls and not parser.well_formed() and choice.mode == "auto":
        return text, []
    return (content or None) if parser.calls else content, parser.calls

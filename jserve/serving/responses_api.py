"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``) on top of the chat endpoint.

A Responses body is read into a chat completion's body (``to_chat``): ``input`` items and
``instructions`` become messages, function tools and ``tool_choice`` their chat spelling,
``text.format`` a ``response_format``, ``max_output_tokens`` ``max_tokens``. From there the
chat endpoint's rules hold unchanged (one authority): templating, tool-call parsing,
structured output, reasoning parsers, limits and refusals, whose field names are mapped back
(``renamed``). The chat reply is then written as a Response (``output_items``): a reasoning
item, a message, function calls, whole or as the Responses event stream (``EventWriter``).

``previous_response_id`` continues a stored conversation: a stored response keeps the
messages it was made from (without its ``instructions``, which OpenAI does not carry over)
and its reply, in a ``ResponseStore`` bounded in bytes (``--responses-store-mib``; 0: none
kept, every response says ``store: false``).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
import secrets
import threading

from jserve.serving.http_protocol import _SAMPLING, BadField, body_object

# The Responses fields read here, and jserve's extras (the chat endpoint's sampling and SLO
# fields and vLLM's ``structured_outputs``, as ``extra_body``).
_OWN = {"model", "input", "instructions", "tools", "tool_choice", "text", "reasoning",
        "max_output_tokens", "previous_response_id", "stream", "store", "temperature", "top_p",
        "metadata", "user", "parallel_tool_calls", "truncation", "include", "background",
        "service_tier", "stream_options"}
_EXTRA = {*_SAMPLING, "ttft_slo", "tpot_slo", "priority", "chat_template_kwargs",
          "structured_outputs"} - {
    "temperature", "top_p"}
FIELDS = _OWN | _EXTRA
# Accepted only at the value that is what jserve does.
_NEUTRAL = {"truncation": ("disabled",), "background": (False,),
            "service_tier": ("auto", "default")}
# Chat field names as the Responses body says them (for the chat endpoint's refusals).
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens",
            "response_format": "text.format"}
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text", "output_text", "text"}
# The Response fields a request sets and the response echoes.
_ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "temperature",
           "top_p", "user", "parallel_tool_calls", "tool_choice", "tools", "text", "reasoning",
           "metadata")


_FLAT = re.compile(r"\b(tools\[\d+\]|tool_choice)\.function\b")  # chat's nesting


def renamed(e: BadField) -> BadField:
    """A refusal of the chat body a Responses body became, naming the Responses field (a
    message's: ``input``, as the items and messages are not one to one)."""
    field, message = e.field, e.message
    for chat, ours in _RENAMED.items():
        if field is not None and re.match(rf"{chat}(\b|$)", field):
            field = ours if chat == "messages" else ours + field[len(chat):]
        message = re.sub(rf"\b{chat}\b", ours, message)
    if field is not None:
        field = _FLAT.sub(r"\1", field)
    return BadField(field, _FLAT.sub(r"\1", message))


# -- the store ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stored:
    response: dict            # the Response object as it was sent
    conversation: list[dict]  # chat messages: what it was made from, then its reply
    size: int                 # bytes, as the store counts them


class ResponseStore:
    """Stored responses by id, least recently used dropped first once their JSON passes
    ``max_bytes`` (0: nothing is kept). Intake threads read it, the event loop writes it."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.max_bytes > 0

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Keeps it (False: it alone is over the bound, so it is not kept)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes:
            return False
        with self._lock:
            self._drop(response["id"])
            self._items[response["id"]] = Stored(response, conversation, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))
        return True

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            s = self._items.get(rid)
            if s is not None:
                self._items.move_to_end(rid)
            return s

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        s = self._items.pop(rid, None)
        if s is not None:
            self._bytes -= s.size
        return s is not None

    def __len__(self) -> int:
        return len(self._items)


# -- a request in ---------------------------------------------------------------------------
@dataclasses.dataclass
class Asked:
    """What a Responses body asked beyond its chat body: what its response echoes, whether
    it is kept, and the conversation it continues (chat messages, no instructions)."""

    echoed: dict
    store: bool
    conversation: list[dict]


def to_chat(body, store: ResponseStore) -> tuple[dict, Asked]:
    """A Responses body -> the chat completion body it means, and what else it asked;
    ``BadField`` naming the Responses field."""
    body = body_object(body, FIELDS)
    for field, ok in _NEUTRAL.items():
        if field in body and body[field] not in ok:
            raise BadField(field, f"{field}={body[field]!r} is not supported by jserve "
                                  f"(only {' or '.join(map(repr, ok))})")
    if body.get("include"):
        raise BadField("include", f"include={body['include']!r} is not supported by jserve "
                                  f"(no extra output data is kept)")
    if "stream_options" in body:
        raise BadField("stream_options", "stream_options is not supported on /v1/responses "
                                         "(usage is always in response.completed)")
    for field in ("store", "stream", "parallel_tool_calls"):
        if field in body and not isinstance(body[field], bool):
            raise BadField(field, f"{field} must be a bool")
    _metadata(body.get("metadata"))
    previous = []
    if "previous_response_id" in body:
        rid = body["previous_response_id"]
        stored = store.get(rid) if isinstance(rid, str) else None
        if stored is None:
            why = "" if store.on else " (this server keeps no responses: --responses-store-mib 0)"
            raise BadField("previous_response_id", f"previous_response_id: no stored response "
                                                   f"{rid!r}{why}")
        previous = stored.conversation
    if "input" not in body:
        raise BadField("input", "input is required")
    conversation = previous + _input_messages(body["input"])
    chat = {k: body[k] for k in ("model", "stream", "temperature", "top_p",
                                 "parallel_tool_calls", *_EXTRA) if k in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadField("instructions", "instructions must be a string")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) \
        + conversation
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if "text" in body:
        if (fmt := _text_format(body["text"])) is not None:
            chat["response_format"] = fmt
    if "reasoning" in body:
        effort = _reasoning(body["reasoning"])
        kwargs = chat.get("chat_template_kwargs", {})
        if effort is not None and isinstance(kwargs, dict):  # (else the chat check refuses)
            # as vLLM and transformers give it to chat templates
            chat["chat_template_kwargs"] = {**kwargs, "reasoning_effort": effort}
    echoed = {k: body.get(k) for k in _ECHOED}
    keep = body.get("store", True) and store.on
    return chat, Asked(echoed, keep, conversation)


def _metadata(m) -> None:
    if m is None:
        return
    if not (isinstance(m, dict) and len(m) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in m.items())):
        raise BadField("metadata", "metadata must be an object of at most 16 string values "
                                   "(keys up to 64 characters, values up to 512)")


def _text(where: str, content) -> str:
    """A message's content: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadField(where, f"{where} must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadField(f"{where}[{j}]", f"{where}[{j}]: only text parts ("
                           f"{', '.join(sorted(_TEXT_PARTS))}) are supported, got {kind!r}")
        out.append(part["text"])
    return "".join(out)


def _input_messages(items) -> list[dict]:
    """``input`` (a string, or items: messages, function calls and their outputs) as chat
    messages. A run of function calls is one assistant message with ``tool_calls`` (joined to
    the assistant message just before it); reasoning items are left out, as chat templates
    leave the reasoning of earlier turns out."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadField("input", "input must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadField(at, f"{at} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise BadField(f"{at}.role", f"{at}.role must be one of {sorted(_ROLES)}, got "
                                             f"{item.get('role')!r}")
            out.append({"role": role, "content": _text(f"{at}.content", item.get("content"))})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise BadField(f"{at}.{k}", f"{at}.{k} must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadField(f"{at}.call_id", f"{at}.call_id must be a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(f"{at}.output", item.get("output"))})
        elif kind == "reasoning":
            continue
        else:
            raise BadField(f"{at}.type", f"{at}.type {kind!r} is not supported by jserve "
                                         f"(message, function_call, function_call_output, "
                                         f"reasoning)")
    if not out:
        raise BadField("input", "input has no message, function call or function output")
    return out


def _tools(tools) -> list[dict]:
    """Function tools (the Responses API's flat spelling) in the chat API's."""
    if not isinstance(tools, list):
        raise BadField("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise BadField(f"tools[{i}].type", f"tools[{i}]: only function tools are "
                                               f"supported by jserve, got type {kind!r}")
        extra = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise BadField(f"tools[{i}].{extra[0]}",
                           f"tools[{i}].{extra[0]} is not supported by jserve")
        out.append({"type": "function", "function": {k: t[k] for k in (
            "name", "description", "parameters", "strict") if t.get(k) is not None}})
    return out


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {
            "type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadField("tool_choice", f"tool_choice must be \"auto\", \"none\", \"required\" or "
                                  f"{{\"type\": \"function\", \"name\"}}, got {choice!r}")


def _text_format(text) -> dict | None:
    """``text.format`` as a chat ``response_format`` (None: plain text)."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise BadField("text", f"text supports only format, got {text!r}")
    if text.get("verbosity") not in (None, "medium"):
        raise BadField("text.verbosity", "text.verbosity is not supported by jserve")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema" and set(fmt) <= {"type", "name", "schema", "strict",
                                                "description"} and "schema" in fmt:
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items()
                                                        if k != "type"}}
    raise BadField("text.format", f"text.format must be {{\"type\": \"text\"}}, "
                                  f"{{\"type\": \"json_object\"}} or {{\"type\": \"json_schema\", "
                                  f"\"name\", \"schema\", \"strict\"}}, got {fmt!r}")


def _reasoning(r) -> str | None:
    """``reasoning``: its effort (given to the chat template). A summary may be asked for,
    but the reasoning item carries the whole reasoning text (``content``), no summary."""
    if not isinstance(r, dict) or set(r) - {"effort", "summary", "generate_summary"}:
        raise BadField("reasoning", f"reasoning supports effort and summary, got {r!r}")
    effort = r.get("effort")
    if effort is not None and effort not in ("minimal", "low", "medium", "high"):
        raise BadField("reasoning.effort", f"reasoning.effort must be minimal, low, medium or "
                                           f"high, got {effort!r}")
    return effort


# -- a response out ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens}}


def status_of(finish_reason: str | None) -> str:
    """A finished reply's status (and its items'): cut by the length, or whole."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(message: dict, finish_reason: str | None) -> list[dict]:
    """A chat reply's message (content, reasoning, tool_calls) as Response output items."""
    status = status_of(finish_reason)
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or "", status))
    items += [call_item(new_id("fc"), c["id"], c["function"]["name"],
                        c["function"]["arguments"], status) for c in calls]
    return items


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def reply_message(items: list[dict]) -> dict:
    """The chat message a response's output is in the next turn's conversation."""
    text = "".join(p["text"] for it in items if it["type"] == "message"
                   for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def response(rid: str, model: str, asked: Asked, created: int, status: str,
             output: list[dict], use: dict | None) -> dict:
    """The Response object; ``status`` in_progress, completed, incomplete or failed."""
    e = asked.echoed
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "model": model, "output": output, "usage": use, "store": asked.store,
            **{k: e[k] for k in ("instructions", "max_output_tokens", "previous_response_id",
                                 "user")},
            "temperature": e["temperature"] if e["temperature"] is not None else 1.0,
            "top_p": e["top_p"] if e["top_p"] is not None else 1.0,
            "parallel_tool_calls": e["parallel_tool_calls"] is not False,
            "tool_choice": e["tool_choice"] or "auto", "tools": e["tools"] or [],
            "text": e["text"] or {"format": {"type": "text"}},
            "reasoning": e["reasoning"] or {"effort": None, "summary": None},
            "truncation": "disabled", "metadata": e["metadata"] or {}}


class EventWriter:
    """The Responses event stream of one reply, from the chat endpoint's stream deltas
    (``content``, ``reasoning``, ``tool_calls`` in OpenAI's chunked form): each output item
    opened when its first piece comes, closed when the next item starts or the reply ends,
    every event numbered."""

    def __init__(self, start: dict):
        self.start = start        # the response, in progress
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._calls: dict[int, dict] = {}  # chat's tool call index -> its item
        self._seq = 0

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return out

    def begin(self) -> list[dict]:
        return [self.event("response.created", response=self.start),
                self.event("response.in_progress", response=self.start)]

    def feed(self, delta: dict) -> list[dict]:
        out: list[dict] = []
        if delta.get("reasoning"):
            out += self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        return out

    def _text(self, kind: str, piece: str) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != kind:
            out += self._close("completed")
            item = reasoning_item(new_id("rs"), "") if kind == "reasoning" else \
                message_item(new_id("msg"), None, "in_progress")
            self._open = item
            added = dict(item, content=[]) if kind == "reasoning" else item
            out.append(self.event("response.output_item.added", output_index=len(self.items),
                                  item=json.loads(json.dumps(added))))
            if kind == "message":
                item["content"].append(text_part(""))
                out.append(self.event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items), content_index=0,
                                      part=text_part("")))
        item = self._open
        item["content"][0]["text"] += piece
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(kind_event, item_id=item["id"], output_index=len(self.items),
                              content_index=0, delta=piece, **extra))
        return out

    def _call(self, call: dict) -> list[dict]:
        out = []
        item = self._calls.get(call["index"])
        if item is None:
            out += self._close("completed")
            item = call_item(new_id("fc"), call["id"], call["function"]["name"], "",
                             "in_progress")
            self._calls[call["index"]] = self._open = item
            out.append(self.event("response.output_item.added", output_index=len(self.items),
                                  item=dict(item)))
        piece = call.get("function", {}).get("arguments") or ""
        if piece:
            item["arguments"] += piece
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=item["id"], output_index=len(self.items),
                                  delta=piece))
        return out

    def _close(self, status: str) -> list[dict]:
        """Ends the open item (its done events), if there is one."""
        item, self._open = self._open, None
        if item is None:
            return []
        at = len(self.items)
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=at, name=item["name"],
                                  arguments=item["arguments"]))
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                  output_index=at, content_index=0,
                                  text=item["content"][0]["text"]))
        else:
            part = item["content"][0]
            out += [self.event("response.output_text.done", item_id=item["id"],
                               output_index=at, content_index=0, text=part["text"],
                               logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"],
                               output_index=at, content_index=0, part=dict(part))]
        if "status" in item:
            item["status"] = status
        self.items.append(item)
        out.append(self.event("response.output_item.done", output_index=at, item=item))
        return out

    def end(self, finish_reason: str | None) -> list[dict]:
        """The open item closed (an empty message if the reply had no item)."""
        status = status_of(finish_reason)
        out = []
        if not any(it["type"] in ("message", "function_call")
                   for it in [*self.items, self._open or {"type": None}]):
            out += self._text("message", "")[:-1]  # opened (the open item closed), no delta
        return out + self._close(status)


def sse_event(e: dict) -> bytes:
    """A Responses event as OpenAI sends it: named, then its data."""
    return f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode()

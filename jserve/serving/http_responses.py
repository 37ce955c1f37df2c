"""OpenAI response objects and server-sent events: one endpoint's ``Formatter`` (completions
or chat), the choices it formats and ``pump``, which reads a request's streams.

A stream carries one SSE chunk per engine step per choice (the tokens that step produced),
however late the event loop gets to them: steps that arrived while the handler waited for the
engine go out as one event each, in one ``send``. Back-pressure: ``send`` waits only when the
client is not reading fast enough (the transport's buffer is over its high-water mark); the
steps that arrived meanwhile were held up by the client, and go out as one chunk per choice
(``pump``'s ``held``). So a client that keeps up sees the engine's rhythm, one that does not
gets fewer, larger chunks (fewer bytes per token) until it catches up, and the engine never
waits for anyone: what a slow client has not taken yet waits in its request's queue on the
event loop (at most the request's tokens)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time

from jserve.engine.requests.output import TokenLogprob
from jserve.serving import engine_api as el, http_echo
from jserve.serving.gateway import Rejected, Stream
from jserve.serving.http_protocol import Parsed
from jserve.serving.reasoning import (
    FORMATS as REASONING,
    ReplyReader,
    opens_thinking,
    split,
)
from jserve.serving.tool_calls import ToolCallParser
from jserve.serving.tool_formats import call_parser, read_calls

_SLOT = re.compile(r'"\\u000[01]"')  # the placeholders of a pre-serialized chunk frame


@dataclasses.dataclass
class Choice:
    index: int
    stream: Stream
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, from the prefix cache (known at the end)
    # The prompt, for echo and prompt_logprobs (``http_echo``): its text when it came as
    # text, its ids, and its logprobs once the engine sends them (with the first tokens).
    prompt: str | None = None
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Formatter:
    """Response objects of one endpoint (completions or chat)."""

    def __init__(self, endpoint: str, rid: str, model: str, tokenizer, parsed: Parsed):
        self.chat = endpoint == "chat"
        self.rid, self.model, self.tok, self.parsed = rid, model, tokenizer, parsed
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self._frame: list[str] | None = None
        # Chat with tools: each choice's output read for calls as it streams.
        self._tools = parsed.tool_choice if self.chat and parsed.tool_choice is not None \
            and parsed.tool_choice.parses else None
        self._parsers: dict[int, ToolCallParser] = {}
        # Chat with a reasoning parser: each choice's reply split into reasoning and answer.
        self._reasoning = REASONING[parsed.reasoning] if self.chat and parsed.reasoning \
            else None
        self._reasoners: dict[int, ReplyReader] = {}
        self._splits = self._tools is not None or self._reasoning is not None

    def _token(self, tid: int) -> str:
        return self.tok.decode([tid]) if self.tok is not None else str(tid)

    def echoed(self, c: Choice) -> str:
        """The prompt text ``echo`` puts before ``c``'s text (kept as ``c.prompt``)."""
        c.prompt = http_echo.prompt_text(c.prompt, c.prompt_ids,
                                         self.tok.decode if self.tok is not None else None)
        return c.prompt

    def logprobs(self, lps: list[TokenLogprob], offset: int = 0, echo: Choice | None = None
                 ) -> dict | None:
        """``lps``' logprobs object; ``echo``: after the prompt tokens of that choice."""
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            def entry(tid, lp):
                s = self._token(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**entry(x.token_id, x.logprob),
                                 "top_logprobs": [entry(t, v) for t, v in x.top]}
                                for x in lps]}
        tokens = [self._token(x.token_id) for x in lps]
        values = [x.logprob for x in lps]
        tops = [{self._token(t): v for t, v in x.top} for x in lps]
        if echo is not None:
            head = http_echo.echo_logprobs(echo.prompt_ids, echo.prompt_logprobs,
                                           self.parsed.logprobs, self._token)
            tokens, values, tops = head[0] + tokens, head[1] + values, head[2] + tops
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def prompt_logprobs(self, c: Choice) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs`` of ``c``'s prompt, as the request asked."""
        return http_echo.vllm_prompt_logprobs(c.prompt_logprobs, self.parsed.prompt_logprobs,
                                              self._token)

    def usage(self, choices: list[Choice]) -> dict:
        """The request's usage: every prompt once, every choice's tokens (all ``best_of``
        of them: each was generated)."""
        return _usage(sum(c.prompt_tokens for c in choices[::self.parsed.best_of]),
                      sum(len(c.token_ids) for c in choices))

    def full(self, choices: list[Choice], generated: list[Choice] | None = None) -> dict:
        """The response of ``choices``; its usage over ``generated`` (default: them)."""
        out = []
        for c in choices:
            item = {"index": c.index, "finish_reason": c.finish_reason,
                    "logprobs": self.logprobs(c.logprobs,
                                              echo=c if self.parsed.echo else None)}
            if self.chat:
                item["message"], called = self.message(c)
                if called:
                    item["finish_reason"] = _called(c.finish_reason)
            else:
                item["text"] = (self.echoed(c) if self.parsed.echo else "") + c.text
                if self.parsed.prompt_logprobs is not None:  # vLLM: per choice
                    item["prompt_logprobs"] = self.prompt_logprobs(c)
            out.append(item)
        response = {"id": self.rid, "object": self.object, "created": self.created,
                    "model": self.model, "choices": out,
                    "usage": self.usage(generated or choices)}
        if self.chat and self.parsed.prompt_logprobs is not None:  # vLLM: once, at the top
            response["prompt_logprobs"] = self.prompt_logprobs(choices[0])
        return response

    def _reasoner(self, c: Choice) -> ReplyReader:
        """A new reader of ``c``'s reply: inside a thinking block from the start when the
        prompt (its last tokens) left one open."""
        return self._reasoning.reader(opens_thinking(self.tok, c.prompt_ids))

    def _with_reasoning(self, out: dict, reasoning: str | None) -> None:
        """Puts the reply's reasoning in ``out``, under vLLM's name and the older one."""
        if self.parsed.include_reasoning:
            out["reasoning"] = out["reasoning_content"] = reasoning

    def message(self, c: Choice) -> tuple[dict, bool]:
        """A chat choice's whole message, and whether it called tools."""
        text, reasoning = c.text, None
        if self._reasoning is not None:
            reasoning, text = split(self._reasoning, text,
                                    opens_thinking(self.tok, c.prompt_ids))
            text = text or ""
        message, calls = {"role": "assistant", "content": text}, None
        if self._tools is not None:
            message["content"], calls = read_calls(self._tools, text)
            if calls:
                message["tool_calls"] = calls
        if self._reasoning is not None:
            message["content"] = message["content"] or None  # vLLM's: no answer, null
            self._with_reasoning(message, reasoning)
        return message, bool(calls)

    def chunk(self, c: Choice, deltas: list[el.Delta], first: bool) -> dict:
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in d.logprobs]
        finish = deltas[-1].finish_reason if deltas else None
        # echo: the first chunk starts with the prompt (text, and tokens in its logprobs)
        echo = c if first and self.parsed.echo else None
        offset = len(c.text) - len(text) + (len(self.echoed(c)) if self.parsed.echo else 0)
        item: dict = {"index": c.index, "finish_reason": finish,
                      "logprobs": self.logprobs(lps, 0 if echo else offset, echo)
                      if lps or echo else None}
        if self.chat and self._splits:
            item["delta"], item["finish_reason"] = self._split_delta(c, text, finish, first)
        elif self.chat:
            item["delta"] = ({"role": "assistant", "content": text} if first else
                             {"content": text} if text or not finish else {})
        else:
            item["text"] = (self.echoed(c) if echo else "") + text
            if first and self.parsed.prompt_logprobs is not None:
                item["prompt_logprobs"] = self.prompt_logprobs(c)
        out = self._wrap([item])
        if self.chat and first and self.parsed.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(c)
        if self.parsed.continuous_usage:
            out["usage"] = _usage(c.prompt_tokens, len(c.token_ids))
        return out

    def _split_delta(self, c: Choice, text: str, finish: str | None, first: bool
                     ) -> tuple[dict, str | None]:
        """A chat chunk's delta and finish reason when the reply is split: into reasoning
        and answer (the reasoning parser), the answer into content and calls (tools)."""
        reasoning = ""
        if self._reasoning is not None:
            r = self._reasoners.get(c.index)
            if r is None:
                r = self._reasoners[c.index] = self._reasoner(c)
            reasoning, text = r.feed(text)
            if finish is not None:
                r2, t2 = r.finish()
                reasoning, text = reasoning + r2, text + t2
        if self._tools is not None:
            delta, finish = self._tool_delta(c, text, finish, first)
        else:
            delta = {"role": "assistant"} if first else {}
            if text or (first and not reasoning):
                delta["content"] = text
        if reasoning:
            self._with_reasoning(delta, reasoning)
        return delta, finish

    def _tool_delta(self, c: Choice, text: str, finish: str | None, first: bool
                    ) -> tuple[dict, str | None]:
        """A chat chunk's delta and finish reason when the output is read for tool calls:
        content as it is known to be content, calls as OpenAI streams them."""
        parser = self._parsers.get(c.index)
        if parser is None:
            parser = self._parsers[c.index] = call_parser(self._tools)
        content, calls = parser.feed(text)
        if finish is not None:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
            if parser.called:
                finish = _called(finish)
        delta: dict = {"role": "assistant"} if first else {}
        if content or (first and not calls):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, finish

    def events(self, c: Choice, deltas: list[el.Delta], held: bool = False,
               first: bool = False) -> bytes:
        """The SSE events of ``deltas`` read at once for choice ``c`` (applied to it here):
        one chunk per engine step, or one for all of them when the client ``held`` them up
        (see the module's doc)."""
        if held:
            apply_deltas(c, deltas)
            return self.chunk_event(c, deltas, first)
        out = []
        for d in deltas:
            apply_deltas(c, (d,))
            out.append(self.chunk_event(c, (d,), first))
            first = False
        return b"".join(out)

    def chunk_event(self, c: Choice, deltas, first: bool) -> bytes:
        """``chunk`` (``c`` already has ``deltas`` applied) as an SSE event; the common chunk
        (not the first, no logprobs) is spliced into a pre-serialized frame, which keeps the
        event loop's share of the GIL (and so the engine thread's slowdown) small."""
        if self._splits and not self._answering(c, first):  # held text makes no chunk
            out = self.chunk(c, deltas, first)
            item = out["choices"][0]
            empty = not (first or item["delta"] or item["finish_reason"] or item["logprobs"])
            return b"" if empty else sse(out)
        if first or self.parsed.logprobs is not None:
            return sse(self.chunk(c, deltas, first))
        if self._frame is None:
            shape = self._wrap(["\0"])
            if self.parsed.continuous_usage:
                shape["usage"] = "\1"
            self._frame = _SLOT.split(json.dumps(shape))
        text = json.dumps("".join(d.text for d in deltas))
        finish = json.dumps(deltas[-1].finish_reason)
        if self.chat:
            delta = f'{{"content": {text}}}' if text != '""' or finish == "null" else "{}"
            item = f'{{"index": {c.index}, "finish_reason": {finish}, "logprobs": null, ' \
                   f'"delta": {delta}}}'
        else:
            item = f'{{"index": {c.index}, "finish_reason": {finish}, "logprobs": null, ' \
                   f'"text": {text}}}'
        f = self._frame
        if len(f) == 2:
            return f"data: {f[0]}{item}{f[1]}\n\n".encode()
        p, n = c.prompt_tokens, len(c.token_ids)
        usage = f'{{"prompt_tokens": {p}, "completion_tokens": {n}, "total_tokens": {p + n}}}'
        return f"data: {f[0]}{item}{f[1]}{usage}{f[2]}\n\n".encode()

    def _answering(self, c: Choice, first: bool) -> bool:
        """Whether ``c``'s split reply has reached a plain answer: past its reasoning, no
        tools to read. Its chunks are then plain content, and go by the frame below."""
        r = self._reasoners.get(c.index)
        return not first and self._tools is None and r is not None and r.answering

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {**self._wrap([]), "usage": self.usage(choices)}

    def _wrap(self, items: list) -> dict:
        out = {"id": self.rid, "object": self.object + ("." if self.chat else "") +
               ("chunk" if self.chat else ""), "created": self.created, "model": self.model,
               "choices": items}
        if self.parsed.include_usage:
            out["usage"] = None
        return out


def best_choices(choices: list[Choice], parsed: Parsed) -> list[Choice]:
    """Each prompt's ``n`` choices of its ``best_of`` (consecutive in ``choices``): those of
    highest cumulative logprob, best first (ties: the earlier), numbered anew; all of them,
    in order, when ``best_of`` is ``n``."""
    if parsed.best_of == parsed.n:
        return choices
    out: list[Choice] = []
    for at in range(0, len(choices), parsed.best_of):
        group = choices[at:at + parsed.best_of]
        ranked = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs))
        out += [dataclasses.replace(c, index=len(out) + k) for k, c in enumerate(ranked[:parsed.n])]
    return out


def _called(finish_reason: str | None) -> str | None:
    """A choice that called tools finished with ``tool_calls`` (unless it was cut short)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def apply_deltas(c: Choice, deltas: list[el.Delta]) -> None:
    for d in deltas:
        if d.prompt_logprobs is not None:
            c.prompt_logprobs = d.prompt_logprobs
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            c.prompt_tokens, c.cached_tokens = d.prompt_tokens, d.cached_tokens



async def pump(choices: list[Choice], on_deltas) -> None:
    """Reads every unfinished choice's stream until all are done, calling ``on_deltas(choice,
    deltas, held)`` (sync or async) with what each choice got since its last call, in arrival
    order; the first ``Rejected`` ends it (after the deltas that came before it). ``held``:
    some of the deltas came while the last ``on_deltas`` was waiting (a ``send`` to a slow
    client: nothing else in it yields to the event loop), so the client held them up;
    otherwise they came while this waited for the engine (or for the event loop)."""
    held = False
    if len(choices) == 1:  # the common case: no reader task, no queue in between
        c = choices[0]
        while not c.stream.done:
            r = on_deltas(c, await c.stream.next(), held)  # next() takes all that is there
            if asyncio.iscoroutine(r):
                await r
            held = c.stream.waiting
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def read(c: Choice) -> None:
        try:
            while not c.stream.done:
                queue.put_nowait((c, await c.stream.next()))
        except Rejected as e:
            queue.put_nowait((c, e))
        queue.put_nowait((c, None))
    readers = [asyncio.ensure_future(read(c)) for c in choices if not c.stream.done]
    try:
        left = len(readers)
        while left:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            got: dict[int, tuple[Choice, list[el.Delta]]] = {}  # per choice, in order
            error = None
            for c, item in items:
                if item is None:
                    left -= 1
                elif isinstance(item, Rejected):
                    error = item
                    break
                else:
                    got.setdefault(c.index, (c, []))[1].extend(item)
            for c, deltas in got.values():
                r = on_deltas(c, deltas, held)
                if asyncio.iscoroutine(r):
                    await r
            held = not queue.empty()
            if error is not None:
                raise error
    finally:
        for r in readers:
            r.cancel()

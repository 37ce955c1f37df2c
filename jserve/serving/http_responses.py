"""OpenAI response objects and server-sent events: one endpoint's ``Formatter`` (completions
or chat), the choices it formats and ``pump``, which reads a request's streams."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from jserve.engine.output import TokenLogprob
from jserve.serving import engine_loop as el
from jserve.serving.gateway import Rejected, Stream
from jserve.serving.http_protocol import Parsed


@dataclasses.dataclass
class Choice:
    index: int
    stream: Stream
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0


class Formatter:
    """Response objects of one endpoint (completions or chat)."""

    def __init__(self, endpoint: str, rid: str, model: str, tokenizer, parsed: Parsed):
        self.chat = endpoint == "chat"
        self.rid, self.model, self.tok, self.parsed = rid, model, tokenizer, parsed
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self._frame: list[str] | None = None

    def _token(self, tid: int) -> str:
        return self.tok.decode([tid]) if self.tok is not None else str(tid)

    def logprobs(self, lps: list[TokenLogprob], offset: int = 0) -> dict | None:
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
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{self._token(t): v for t, v in x.top} for x in lps],
                "text_offset": offsets}

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(c.prompt_tokens for c in choices[::self.parsed.n])
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def full(self, choices: list[Choice]) -> dict:
        out = []
        for c in choices:
            item = {"index": c.index, "finish_reason": c.finish_reason,
                    "logprobs": self.logprobs(c.logprobs)}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            out.append(item)
        return {"id": self.rid, "object": self.object, "created": self.created,
                "model": self.model, "choices": out, "usage": self.usage(choices)}

    def chunk(self, c: Choice, deltas: list[el.Delta], first: bool) -> dict:
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in d.logprobs]
        finish = deltas[-1].finish_reason if deltas else None
        item: dict = {"index": c.index, "finish_reason": finish,
                      "logprobs": self.logprobs(lps, len(c.text) - len(text))
                      if lps else None}
        if self.chat:
            item["delta"] = ({"role": "assistant", "content": text} if first else
                             {"content": text} if text or not finish else {})
        else:
            item["text"] = text
        return self._wrap([item])

    def chunk_event(self, c: Choice, deltas: list[el.Delta], first: bool) -> bytes:
        """``chunk`` as an SSE event; the common chunk (not the first, no logprobs) is
        spliced into a pre-serialized frame, which keeps the event loop's share of the GIL
        (and so the engine thread's slowdown) small."""
        if first or self.parsed.logprobs is not None:
            return sse(self.chunk(c, deltas, first))
        if self._frame is None:
            self._frame = json.dumps(self._wrap(["\0"])).split('"\\u0000"')
        text = json.dumps("".join(d.text for d in deltas))
        finish = json.dumps(deltas[-1].finish_reason)
        if self.chat:
            delta = f'{{"content": {text}}}' if text != '""' or finish == "null" else "{}"
            item = f'{{"index": {c.index}, "finish_reason": {finish}, "logprobs": null, ' \
                   f'"delta": {delta}}}'
        else:
            item = f'{{"index": {c.index}, "finish_reason": {finish}, "logprobs": null, ' \
                   f'"text": {text}}}'
        return f"data: {self._frame[0]}{item}{self._frame[1]}\n\n".encode()

    def usage_chunk(self, choices: list[Choice]) -> dict:
        return {**self._wrap([]), "usage": self.usage(choices)}

    def _wrap(self, items: list[dict]) -> dict:
        out = {"id": self.rid, "object": self.object + ("." if self.chat else "") +
               ("chunk" if self.chat else ""), "created": self.created, "model": self.model,
               "choices": items}
        if self.parsed.include_usage:
            out["usage"] = None
        return out


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def apply_deltas(c: Choice, deltas: list[el.Delta]) -> None:
    for d in deltas:
        c.text += d.text
        c.token_ids += d.token_ids
        c.logprobs += d.logprobs
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            c.prompt_tokens = d.prompt_tokens



async def pump(choices: list[Choice], on_deltas) -> None:
    """Reads every unfinished choice's stream until all are done, calling ``on_deltas(choice,
    deltas)`` (sync or async) in arrival order; the first ``Rejected`` ends it."""
    if len(choices) == 1:  # the common case: no reader task, no queue in between
        c = choices[0]
        while not c.stream.done:
            r = on_deltas(c, await c.stream.next())
            if asyncio.iscoroutine(r):
                await r
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def read(c: Choice) -> None:
        try:
            while not c.stream.done:
                await queue.put((c, await c.stream.next()))
        except Rejected as e:
            await queue.put((c, e))
        await queue.put((c, None))
    readers = [asyncio.ensure_future(read(c)) for c in choices if not c.stream.done]
    try:
        left = len(readers)
        while left:
            c, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Rejected):
                raise item
            else:
                r = on_deltas(c, item)
                if asyncio.iscoroutine(r):
                    await r
    finally:
        for r in readers:
            r.cancel()


"""What the engine hands back: per-request outputs, incremental detokenization, stop checks.

``RequestOutput`` has vLLM's meaning: what one prompt has produced, its sequences in
``outputs`` (``CompletionOutput``s, index 0..n-1, logprobs as vLLM's ``{token id:
Logprob}`` per token). The engine runs one sequence per request, so its outputs hold one;
``LLM.generate`` groups a prompt's ``n`` sequences into one (``group``). The flat fields
(``text``, ``token_ids``, ``logprobs`` as ``TokenLogprob``s, ``finish_reason``,
``num_tokens``) are the first sequence's: what the serving layer streams, and what code
written before ``n`` reads.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jserve.lengths import length_room
from jserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) best first; empty when logprobs=0
    rank: int | None = None  # 1 + tokens more likely than it (prompt logprobs; else unknown)


class StepLogprobs:
    """A step's logprobs read back (the chosen tokens' and the top ones, per sampled row)."""

    def __init__(self, out):
        self.chosen, self.top_ids, self.top_lp = (
            np.asarray(a) for a in (out.logprobs, out.top_ids, out.top_logprobs))

    def token(self, row: int, token_id: int, n: int) -> TokenLogprob:
        """Row ``row``'s ``token_id`` with its ``n`` best alternatives."""
        return TokenLogprob(token_id, float(self.chosen[row]), tuple(
            zip(self.top_ids[row, :n].tolist(), self.top_lp[row, :n].tolist())))


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's per-token logprob entry: the logprob, its rank in the vocabulary (1: the most
    likely; None for a chosen token outside the top ones, whose rank is not computed) and
    the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One sequence of a prompt, as vLLM's: ``cumulative_logprob`` and ``logprobs`` are
    None unless logprobs were asked for; ``logprobs[i]`` maps the chosen token and the top
    ones to their ``Logprob``; ``stop_reason`` is the stop token id or string that ended it
    (None for EOS or a length limit)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Times from ``time.monotonic()``: arrival, first token, every token, finish."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finished_time: float | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (last admission)
    restored_tokens: int = 0  # of them, tokens copied back from its host tier
    # Speculative decoding: draft tokens verified for this request, and accepted.
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclasses.dataclass
class RequestOutput:
    """A prompt's outputs after a step (see the module's doc). The generated ids and
    logprobs are views of the request's growing lists cut at this output's length
    (``token_ids`` copies on access, ``outputs`` builds its objects on access): making an
    output every step costs O(1), not O(tokens so far)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort'
    metrics: RequestMetrics
    num_tokens: int            # generated tokens so far
    error: str | None = None   # set when the engine failed the request
    _ids: list[int] = dataclasses.field(default_factory=list, repr=False)
    _logprobs: list[TokenLogprob] | None = dataclasses.field(default=None, repr=False)
    # SamplingParams.prompt_logprobs: entry i is prompt token i's given those before it (the
    # first None); whole once the prompt is prefilled (the request's own list, do not edit).
    prompt_logprobs: list[TokenLogprob | None] | None = dataclasses.field(default=None,
                                                                           repr=False)
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    # runner "pooling": the prompt's pooled vector (float32 [hidden], before ``dimensions``
    # and normalization: ``jserve.pooling.finish``)
    embedding: np.ndarray | None = dataclasses.field(default=None, repr=False)
    _tokenizer: Tokenizer | None = dataclasses.field(default=None, repr=False)
    _more: tuple[RequestOutput, ...] = dataclasses.field(default=(), repr=False)  # n > 1

    @property
    def token_ids(self) -> list[int]:
        return self._ids[:self.num_tokens]

    @property
    def outputs(self) -> list[CompletionOutput]:
        return [seq.completion(i) for i, seq in enumerate((self, *self._more))]

    @staticmethod
    def group(sequences: list[RequestOutput]) -> RequestOutput:
        """One output of a prompt's sequences (``outputs`` in this order; the flat fields,
        id and metrics the first one's)."""
        return dataclasses.replace(sequences[0], _more=tuple(sequences[1:]))

    def completion(self, index: int) -> CompletionOutput:
        """This sequence (its first, if grouped) as vLLM's ``CompletionOutput``."""
        lps = self.logprobs
        return CompletionOutput(
            index, self.text, self.token_ids,
            None if lps is None else sum(lp.logprob for lp in lps),
            None if lps is None else [self._logprob_map(lp) for lp in lps],
            self.finish_reason, self.stop_reason)

    def _logprob_map(self, lp: TokenLogprob) -> dict[int, Logprob]:
        """vLLM's entry of one token: the chosen one first, then the top ones (ranked)."""
        decode = (lambda t: self._tokenizer.decode([t])) if self._tokenizer else lambda t: None
        top = {t: Logprob(v, rank, decode(t)) for rank, (t, v) in enumerate(lp.top, 1)}
        chosen = top.pop(lp.token_id, None) or Logprob(lp.logprob, lp.rank,
                                                       decode(lp.token_id))
        return {lp.token_id: chosen, **top}

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return None if self._logprobs is None else self._logprobs[:self.num_tokens]

    def new_token_ids(self, start: int) -> list[int]:
        """Generated ids from ``start`` on (what a stream has not sent yet)."""
        return self._ids[start:self.num_tokens]

    def new_logprobs(self, start: int) -> list[TokenLogprob]:
        return [] if self._logprobs is None else self._logprobs[start:self.num_tokens]

    def stopped_at(self, n_tokens: int) -> RequestOutput:
        """This output as ended by a stop at its ``n_tokens``-th generated token, found where
        its text is made apart from the engine (``core_process``): what the engine made past
        it is not part of it, nor of its token times."""
        m = dataclasses.replace(self.metrics, token_times=self.metrics.token_times[:n_tokens])
        return dataclasses.replace(self, finished=True, finish_reason="stop", error=None,
                                   metrics=m, num_tokens=min(n_tokens, self.num_tokens))


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without re-decoding everything each step.

    Decodes a short window before the newest tokens so multi-token characters come out whole;
    text ending in U+FFFD (an incomplete UTF-8 sequence) is held back until it completes.
    """

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """The held-back tail, decoded as is (at the end of a request)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        ids, skip = self.ids, self.skip
        prefix = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset], skip)
        full = self.tokenizer.decode(ids[self.prefix_offset:], skip)
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return ""
        self.prefix_offset = len(self.ids) if final else self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]


def find_stop(text: str, new_from: int, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts, searching only where new text could
    complete one (from ``new_from`` minus the longest stop's length)."""
    if not stops:
        return None
    lo = max(0, new_from - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, lo) for s in stops) if i != -1]
    return min(hits) if hits else None


def stops_on(tok: int, params, eos_ids: tuple[int, ...]) -> bool:
    """Whether ``tok`` is a stop token for ``params``: one of its ``stop_token_ids``, or an
    EOS id unless it ignores EOS. A stop token's own text is not part of the output."""
    return tok in params.stop_token_ids or (tok in eos_ids and not params.ignore_eos)


class StopText:
    """A request's text as its generated tokens arrive, and the stops text decides: stop
    tokens and stop strings, neither before ``min_tokens`` tokens (vLLM's rule). The one
    authority for them, so the engine's output processing and the fake engine cut a text
    at the same token. Length and grammar ends are the caller's (they need the context)."""

    def __init__(self, tokenizer: Tokenizer | None, params, eos_ids: tuple[int, ...]):
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.params = params
        self.eos_ids = eos_ids
        self.text = ""
        self.tokens = 0
        self.stop_reason: int | str | None = None  # the stop token id or string that ended it

    def add(self, tok: int) -> bool:
        """Feeds the next generated token; True when it ends the output (the text is then
        final: cut where a stop string starts, or flushed before a stop token)."""
        p = self.params
        self.tokens += 1
        if self.tokens >= p.min_tokens and stops_on(tok, p, self.eos_ids):
            self.stop_reason = tok if tok in p.stop_token_ids else None
            self.finish()
            return True
        before = len(self.text)
        self.text += self.detok.add(tok)
        cut = find_stop(self.text, before, p.stop) if self.tokens >= p.min_tokens else None
        if cut is None:
            return False
        self.stop_reason = next(s for s in p.stop if self.text.startswith(s, cut))
        self.text = self.text[:cut]
        return True

    def finish(self) -> None:
        """The output ends here for another reason (length, a grammar): the held-back
        tail is decoded."""
        self.text += self.detok.flush()


class HeldBack:
    """What of a growing text a stream may send now: all of it once final; before that, all
    but the last ``len(longest stop string) - 1`` characters, which a stop string completed
    later may still cut (what was sent must stay a prefix of the final text)."""

    def __init__(self, stops: tuple[str, ...]):
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0  # characters sent

    def take(self, text: str, final: bool) -> str:
        end = len(text) if final else len(text) - self.hold
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece


class OutputProcessor:
    """Turns each new token of a request into its output: logprobs, text (incremental
    detokenization), and the stop decision (stop and EOS ids, stop strings, ``max_tokens``,
    the context length). The request's ``payload`` is its ``RequestState``."""

    def __init__(self, max_model_len: int, pooling: bool = False):
        self.max_model_len = max_model_len
        self.pooling = pooling  # every request ends with its prefill (requests.pooling)

    def may_continue(self, req, new_tokens: int = 1, late_masks: bool = False) -> bool:
        """Whether ``req`` may decode again before its newest ``new_tokens`` (still on the
        device) are read: not if they end it by length (``max_tokens``, the context), nor
        under a structured output unless its next mask can be sent late (``late_masks``:
        the engine samples that step after reading the token). A stop token or string, or
        a completed grammar, still can; the extra token is then dropped."""
        st = req.payload
        if self.pooling or (st.constraint is not None and not late_masks):
            return False
        return req.room(self.max_model_len, new_tokens) > 0

    def _by_length(self, req, n_out: int) -> bool:
        """Whether ``n_out`` generated tokens (read by the host) end ``req`` by length."""
        return length_room(req.max_tokens, req.num_prompt_tokens, n_out,
                           self.max_model_len) <= 0

    def add_token(self, req, tok: int, now: float, logprob: TokenLogprob | None = None
                  ) -> str | None:
        """Processes ``req``'s next generated token ``tok``; returns the finish reason ('stop'
        or 'length', the text then final) or None. (Its own list, not ``req.token_ids``,
        which may already hold placeholders for tokens still on the device.)"""
        st = req.payload
        p = st.params
        if p.max_tokens == 0 or self.pooling:  # prompt scoring or an embedding only: the
            return "length"                     # prefill's sampled token is dropped
        st.output_ids.append(tok)
        if logprob is not None:
            st.logprobs.append(logprob)
        m = st.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        n_out = len(st.output_ids)
        reason = "stop" if st.out.add(tok) else None
        if reason is None and st.constraint is not None and _completes(st.constraint, tok):
            reason = "stop"
            st.out.finish()
        if reason is None and self._by_length(req, n_out):
            reason = "length"
            st.out.finish()
        return reason

    @staticmethod
    def finished(req, reason: str, error: str | None, now: float) -> None:
        """Marks ``req`` done (reason 'stop', 'length' or 'abort')."""
        st = req.payload
        st.finish_reason = reason
        st.error = error
        st.metrics.finished_time = now
        st.metrics.cached_tokens = req.num_cached_tokens
        st.metrics.restored_tokens = req.num_restored_tokens
        st.metrics.draft_tokens, st.metrics.accepted_tokens = req.num_drafted, req.num_accepted

    @staticmethod
    def output(req) -> RequestOutput:
        st = req.payload
        return RequestOutput(
            request_id=req.request_id, prompt=st.prompt, prompt_token_ids=req.prompt_token_ids,
            text=st.out.text, finished=st.finish_reason is not None,
            finish_reason=st.finish_reason, metrics=st.metrics,
            num_tokens=len(st.output_ids), error=st.error, _ids=st.output_ids,
            _logprobs=st.logprobs, prompt_logprobs=st.prompt_logprobs,
            stop_reason=st.out.stop_reason, embedding=st.embedding,
            _tokenizer=st.out.detok.tokenizer)


def _completes(constraint, tok: int) -> bool:
    """Feeds ``tok`` to a structured output: True once the output is complete (the grammar
    allows nothing more), or if the grammar refused the token (only possible when a ban,
    e.g. ``min_tokens``'s, left no allowed token: the output then ends where it is)."""
    if not constraint.advance(tok):
        log.warning("structured output: the grammar refused token %d; ending the request", tok)
        return True
    return constraint.done

"""What the engine keeps per request beside the scheduler's ``Request`` (its ``payload``):
sampling parameters and seed, text and logprobs so far, metrics, and the device row that
holds its penalty state."""
from __future__ import annotations

import dataclasses

import numpy as np

from jserve.engine.requests.intake import PreparedRequest
from jserve.engine.requests.output import RequestMetrics, StopText, TokenLogprob
from jserve.sampling.params import MAX_BANNED_IDS, SamplingParams
from jserve.sampling.sampler import SamplerRow
from jserve.sampling.structured import Constraint, GrammarCompiler
from jserve.scheduler import PLACEHOLDER, Request
from jserve.tokenizer import Tokenizer

NEUTRAL_ROW = SamplerRow(SamplingParams(temperature=0.0), seed=0, step=0)  # padding rows


@dataclasses.dataclass(eq=False)
class RequestState:
    params: SamplingParams
    seed: int
    prompt: str | None
    metrics: RequestMetrics
    out: StopText  # the text so far and the stop it ended at
    output_ids: list[int] = dataclasses.field(default_factory=list)  # tokens the host has read
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None] + one per prompt token
    embedding: np.ndarray | None = None  # runner "pooling": set when the prompt is prefilled
    state_row: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    constraint: Constraint | None = None  # structured output: where it is in its grammar


def sampler_row(req: Request, eos_ids: tuple[int, ...]) -> SamplerRow:
    """The sampler's view of ``req`` for its next token: stop and EOS ids are banned until
    ``min_tokens`` are out; a structured output allows only what its grammar does, once the
    host has read the token before (``mask_pending``: the engine sends the mask late)."""
    st: RequestState = req.payload
    p = st.params
    banned: tuple[int, ...] = ()
    if req.num_output_tokens < p.min_tokens:
        banned = (p.stop_token_ids + (() if p.ignore_eos else eos_ids))[:MAX_BANNED_IDS]
    allowed = st.constraint.mask() if st.constraint is not None and not mask_pending(req) \
        else None
    return SamplerRow(p, st.seed, req.num_output_tokens, banned, allowed)


def plain_sampler_row(req: Request) -> bool:
    """Whether ``sampler_row(req)`` bans nothing and masks nothing: past ``min_tokens``, no
    structured output (what lets ``StepBuilder`` reuse the last step's sampling rows)."""
    st: RequestState = req.payload
    return st.constraint is None and req.num_output_tokens >= st.params.min_tokens


def mask_pending(req: Request) -> bool:
    """A structured output whose newest token is still on the device (async scheduling):
    its next mask is not known until the host reads that token."""
    return req.payload.constraint is not None and req.all_token_ids[-1:] == [PLACEHOLDER]


class StateRows:
    """Device rows of per-request sampling state (penalty counts): a running request keeps
    its row from its first chunk until it is preempted or finishes."""

    def __init__(self, num_rows: int):
        self._free = list(range(num_rows - 1, -1, -1))

    def assign(self, req: Request) -> int:
        st: RequestState = req.payload
        if st.state_row is None:
            st.state_row = self._free.pop()
        return st.state_row

    def release(self, req: Request) -> None:
        st: RequestState = req.payload
        if st.state_row is not None:
            self._free.append(st.state_row)
            st.state_row = None


def new_request(prepared: PreparedRequest, request_id: str, seed: int, arrival_time: float,
                tokenizer: Tokenizer | None, ttft_slo: float | None = None,
                tpot_slo: float | None = None, priority: int = 0,
                grammars: GrammarCompiler | None = None, eos_ids: tuple[int, ...] = ()
                ) -> Request:
    """The scheduler's ``Request`` for a prepared prompt, with the engine's ``RequestState``
    as its payload (``ttft_slo``: seconds after arrival)."""
    p = prepared.params
    state = RequestState(
        params=p, seed=seed, prompt=prepared.prompt, metrics=RequestMetrics(arrival_time),
        out=StopText(tokenizer if p.detokenize else None, p, eos_ids),
        logprobs=[] if p.logprobs is not None else None,
        prompt_logprobs=[None] if p.prompt_logprobs is not None else None,
        constraint=(grammars.start(p.structured_output)  # cached by prepare
                    if p.structured_output is not None else None))
    # The prompt held once: ``Request.prompt_token_ids`` (outputs show it; ``all_token_ids`` starts
    # as its copy and grows).
    req = Request(request_id, list(prepared.prompt_ids), p.max_tokens, arrival_time, payload=state,
                  tpot_slo=tpot_slo, priority=priority,
                  cacheable=not p.uses_penalties,  # penalties count every token
                  takes_cached=p.prompt_logprobs is None,  # each prompt token's logprob
                  adapter=prepared.adapter)
    if ttft_slo is not None:
        req.ttft_deadline = arrival_time + ttft_slo
    return req

"""The prompt in an OpenAI response: the completions API's ``echo`` (the prompt's text before
each choice's, and with ``logprobs`` its tokens before the generated ones, as OpenAI's legacy
completions and vLLM return them: the first token's logprob and alternatives null) and
vLLM's ``prompt_logprobs`` field (per position {token id: {logprob, rank, decoded_token}},
the first null). The engine's ``SamplingParams.prompt_logprobs`` gives the values."""
from __future__ import annotations

from typing import Callable, Sequence

from jserve.engine.requests.output import TokenLogprob

# A logprob JSON can carry (OpenAI and vLLM write -inf so too).
_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def prompt_text(prompt: str | None, prompt_ids: Sequence[int], decode) -> str:
    """What ``echo`` puts before a choice's text: the prompt as it came, or a prompt of token
    ids decoded (``decode``: the tokenizer's, None without one)."""
    if prompt is not None:
        return prompt
    return decode(list(prompt_ids)) if decode is not None else ""


def echo_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None,
                  n: int, token: Callable[[int], str]
                  ) -> tuple[list[str], list[float | None], list[dict | None]]:
    """The prompt's part of an echoed ``logprobs`` object: its tokens, their logprobs and
    their top ``n`` alternatives with the token itself (OpenAI's "up to logprobs + 1"); the
    first token's logprob and alternatives are null."""
    tokens = [token(t) for t in prompt_ids]
    logprobs: list[float | None] = [None]
    tops: list[dict | None] = [None]
    for e in list(entries or [None])[1:len(prompt_ids)]:
        logprobs.append(_value(e.logprob))
        top = {tokens[len(tops)]: _value(e.logprob)}
        for tid, lp in e.top[:n]:
            top.setdefault(token(tid), _value(lp))
        tops.append(top)
    missing = len(tokens) - len(tops)  # (a prompt not wholly scored: none of ours)
    return tokens, logprobs + [None] * missing, tops + [None] * missing


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob | None] | None, k: int,
                         token: Callable[[int], str]) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position, the prompt token (its rank among the
    vocabulary) and the top ``k`` (ranks 1..k), keyed by token id; the first null."""
    if entries is None:
        return None
    out: list[dict | None] = [None]
    for e in entries[1:]:
        d = {str(e.token_id): _entry(e.logprob, e.rank, token(e.token_id))}
        for rank, (tid, lp) in enumerate(e.top[:k], 1):
            d.setdefault(str(tid), _entry(lp, rank, token(tid)))
        out.append(d)
    return out


def _entry(logprob: float, rank: int | None, decoded: str) -> dict:
    return {"logprob": _value(logprob), "rank": rank, "decoded_token": decoded}

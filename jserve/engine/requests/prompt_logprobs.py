"""Prompt logprobs (``SamplingParams.prompt_logprobs``; vLLM's field, lm-eval's loglikelihood
through the completions API's ``echo``): the logprob of each prompt token given the tokens
before it, taken in the prefill that runs the prompt anyway, never in a second pass.

The step's forward has the residual stream of every token it schedules. The host marks each
token whose next token is a known prompt token with that token as its *target*
(``StepArrays.prompt_targets``; across chunks too: a chunk's last token targets the next
chunk's first) and sets ``want_prompt_logprobs``; the step then runs the LM head over its
tokens in blocks of rows (``block_rows``: a block's logits stay near 64 MiB however long the
step) and keeps per token only what is asked: the target's logprob (its logit less the
block's log-sum-exp), its rank, and alternatives only as many as a request wants
(``prompt_top``: none; the best one, a max over the logits, which lm-eval's ``logprobs: 1``
asks for; else the top ``MAX_LOGPROBS``, a sort). A block without targets (decodes, other
requests' chunks, padding) skips the head; a step without any skips it all (``lax.cond``:
no cost).

A request with prompt logprobs takes no pages from the prefix cache (``Request
.takes_cached``), so every prompt token goes through the model; its own full pages are still
offered to the cache. Entries are recorded by position, once: a recompute after preemption
runs the prompt again and adds nothing twice."""
from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jserve.config import ModelConfig
from jserve.engine.requests.output import TokenLogprob
from jserve.model.decoder import Params, head_logits
from jserve.sampling.params import MAX_LOGPROBS

BLOCK_LOGITS = 1 << 24  # float32 logits of one block of rows (64 MiB)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """One step's prompt logprobs, per token of the step (zeros where it has no target)."""

    logprob: jax.Array       # [T] float32: of the token's target
    rank: jax.Array          # [T] int32: 1 + tokens whose logit is above the target's
    top_ids: jax.Array       # [T, MAX_LOGPROBS] int32 (the first ``prompt_top``, else zeros)
    top_logprobs: jax.Array  # [T, MAX_LOGPROBS] float32


def block_rows(tokens: int, vocab_size: int) -> int:
    """Rows of one block: a power of two with ``BLOCK_LOGITS`` logits at most (at least 8),
    or every token when they fit in one."""
    rows = max(8, 1 << max(0, (BLOCK_LOGITS // vocab_size).bit_length() - 1))
    return min(tokens, rows)


def zeros(t: int) -> PromptLogprobs:
    """A step of ``t`` tokens with no prompt logprobs."""
    k = MAX_LOGPROBS
    return PromptLogprobs(jnp.zeros((t,), jnp.float32), jnp.zeros((t,), jnp.int32),
                          jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k), jnp.float32))


def _block(params: Params, x: jax.Array, targets: jax.Array, top: jax.Array,
           cfg: ModelConfig) -> PromptLogprobs:
    """One block of rows: the head, then only the log-sum-exp, the target's logit and its
    rank (no full log-softmax); ``top`` alternatives (0, 1: a max, more: the top-k)."""
    logits = head_logits(params, x, cfg)  # [b, V] float32
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=1)[:, 0]
    rank = 1 + jnp.sum(logits > target[:, None], axis=1, dtype=jnp.int32)
    empty = zeros(x.shape[0])

    def best():  # the first id at the max (as argmax; a plain min reduces faster on CPU)
        high = jnp.max(logits, axis=-1)
        vocab = jnp.arange(logits.shape[1], dtype=jnp.int32)
        ids = jnp.min(jnp.where(logits == high[:, None], vocab, logits.shape[1]), axis=-1)
        return (empty.top_ids.at[:, 0].set(ids), empty.top_logprobs.at[:, 0].set(high - lse))

    def top_k():
        values, ids = jax.lax.top_k(logits, MAX_LOGPROBS)
        return ids.astype(jnp.int32), values - lse[:, None]
    top_ids, top_lp = jax.lax.switch(jnp.minimum(top, 2), [
        lambda: (empty.top_ids, empty.top_logprobs), best, top_k])
    return PromptLogprobs(target - lse, rank, top_ids, top_lp)


def compute(params: Params, x: jax.Array, targets: jax.Array, top: jax.Array,
            cfg: ModelConfig) -> PromptLogprobs:
    """Prompt logprobs of the residual stream ``x`` [T, hidden] (after the last layer) for
    ``targets`` [T] (-1: none), block by block."""
    t = x.shape[0]
    b = block_rows(t, cfg.vocab_size)

    def one(xb, tb):
        return jax.lax.cond(jnp.any(tb >= 0),
                            lambda: _block(params, xb, tb, top, cfg),
                            lambda: zeros(xb.shape[0]))
    if b == t:
        return one(x, targets)
    n = -(-t // b)
    xs = jnp.pad(x, ((0, n * b - t), (0, 0))).reshape(n, b, x.shape[1])
    ts = jnp.pad(targets, (0, n * b - t), constant_values=-1).reshape(n, b)
    out = jax.lax.map(lambda a: one(*a), (xs, ts))
    return jax.tree.map(lambda a: a.reshape((n * b,) + a.shape[2:])[:t], out)


def of_step(params: Params, x: jax.Array, arrays, cfg: ModelConfig) -> PromptLogprobs:
    """The step's prompt logprobs (``arrays``: its ``StepArrays``); zeros, and nothing
    computed, when no token of it has a target."""
    return jax.lax.cond(
        arrays.want_prompt_logprobs,
        lambda: compute(params, x, arrays.prompt_targets, arrays.prompt_top, cfg),
        lambda: zeros(x.shape[0]))


# -- host side ---------------------------------------------------------------------------
def wanted(req) -> bool:
    """Whether ``req`` (its payload a ``RequestState``) wants prompt logprobs."""
    return req.payload.prompt_logprobs is not None


def targets(prompt_ids: list[int], start: int, n: int) -> np.ndarray:
    """The targets of a chunk's tokens at positions ``start .. start + n``: the next prompt
    token, -1 from the prompt's last token on (its next token is sampled, not scored)."""
    out = np.full(n, -1, np.int32)
    last = min(start + n, len(prompt_ids) - 1)
    if last > start:
        out[:last - start] = prompt_ids[start + 1:last + 1]
    return out


def record(out: PromptLogprobs, first_token: int, chunks, requests, live) -> None:
    """Adds the prompt logprobs a step computed to its requests' lists: ``chunks`` its
    prefill chunks (in step order, their tokens from ``first_token`` on), ``requests``
    theirs; ``live(req)``: still running. Each position is added once, in order. Only what
    is asked is read back (the alternatives only for a request that wants them)."""
    host: dict[str, np.ndarray] = {}

    def read(name: str) -> np.ndarray:
        if name not in host:
            host[name] = np.asarray(getattr(out, name))
        return host[name]
    start = first_token
    for c, req in zip(chunks, requests):
        st = req.payload
        have = st.prompt_logprobs
        end = min(c.start + c.num_tokens, req.num_prompt_tokens - 1)
        # (``have`` holds positions before ``c.start`` already: chunks come back in order)
        if have is not None and live(req) and c.start < len(have) < end + 1:
            first, k = len(have) - 1, st.params.prompt_logprobs
            lo, hi = start - c.start + first, start - c.start + end
            targets = req.prompt_token_ids[first + 1:end + 1]
            lp, rank = read("logprob")[lo:hi].tolist(), read("rank")[lo:hi].tolist()
            tops = itertools.repeat(()) if k == 0 else (
                tuple(zip(i, v)) for i, v in zip(read("top_ids")[lo:hi, :k].tolist(),
                                                 read("top_logprobs")[lo:hi, :k].tolist()))
            have.extend(map(TokenLogprob, targets, lp, tops, rank))
        start += c.num_tokens

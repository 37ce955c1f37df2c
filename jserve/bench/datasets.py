"""The request sets of ``jserve bench serve``, as vLLM's ``bench serve`` draws them, turned into
the replay harness's trace requests and prompts (``jserve.bench.replay.run_http``):

- random: prompts of ``input_len`` tokens and outputs of ``output_len``, each drawn uniformly
  from ``[len x (1 - range_ratio), len x (1 + range_ratio)]``. Token-id prompts for
  ``/v1/completions`` (exact lengths, no tokenizer needed); text for the chat endpoint, made
  from random ids through a tokenizer until it encodes to the drawn length.
- sharegpt: a local ShareGPT JSON file (a list of ``{"conversations": [{"from", "value"},
  ...]}``): the first turn is the prompt, the second's length the output length (or a fixed
  one); pairs shorter than 4 tokens, prompts over 1024 or pairs over 2048 are left out.
- custom: a JSONL file with a ``prompt`` per line and optionally its ``output_tokens``.

ShareGPT and custom prompts are shuffled by the seed; too few valid ones are repeated to make
up the number asked (vLLM's oversampling). Arrivals: every request at once (rate inf), or
gaps from a gamma distribution (Poisson at burstiness 1) scaled so the last arrival is at
``n / rate``, as vLLM spaces them.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Protocol

import numpy as np

from jserve.sim.trace import TraceRequest

log = logging.getLogger(__name__)

SHAREGPT_MIN_TOKENS, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048  # vLLM's filter


class TextTokenizer(Protocol):
    """What the datasets need of a tokenizer: text to ids and back, no special tokens."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


class LocalTokenizer:
    """A tokenizer directory (``tokenizer.json``, or jserve's byte-tokenizer marker)."""

    def __init__(self, path: str | Path):
        from jserve.tokenizer import load_tokenizer

        self._tok = load_tokenizer(path)
        if self._tok is None:
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
        self.vocab_size = self._tok.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class ServerTokenizer:
    """The server's own tokenizer through vLLM's ``/tokenize`` and ``/detokenize`` (jserve
    serves both): no tokenizer files needed on the client."""

    def __init__(self, url: str, model: str, headers: dict[str, str], vocab_size: int | None):
        import httpx2 as httpx

        self._client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60)
        self._model = model
        self.vocab_size = vocab_size

    def _post(self, path: str, body: dict) -> dict:
        r = self._client.post(path, json={"model": self._model, **body})
        if r.status_code != 200:
            raise ValueError(f"{path} answered HTTP {r.status_code}: {r.text[:200]} (give "
                             "--tokenizer DIR to tokenize on the client)")
        return r.json()

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]


def _lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> list[int]:
    lo, hi = max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))
    return rng.integers(lo, hi + 1, n).tolist()


def random_samples(n: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, rng: np.random.Generator,
                   tokenizer: TextTokenizer | None = None) -> list[Sample]:
    """Token-id prompts, or text ones through ``tokenizer`` (for the chat endpoint)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    ins = _lengths(rng, n, input_len, range_ratio)
    outs = _lengths(rng, n, output_len, range_ratio)
    out = []
    for p, o in zip(ins, outs):
        ids = rng.integers(0, vocab_size, p).tolist()
        if tokenizer is None:
            out.append(Sample(ids, p, o))
        else:
            text, p = _text_of(tokenizer, ids, p, vocab_size, rng)
            out.append(Sample(text, p, o))
    return out


def _text_of(tok: TextTokenizer, ids: list[int], length: int, vocab_size: int,
             rng: np.random.Generator) -> tuple[str, int]:
    """Text that encodes to ``length`` tokens (decoding random ids and encoding the text back
    changes the count; a few rounds of cutting or topping up settle it); its length. Ids that
    decode to part of a character are dropped: the replacement character they leave would
    encode to more tokens on every round."""
    for _ in range(16):
        text = tok.decode(ids).replace("\ufffd", "")
        got = tok.encode(text)
        if len(got) == length:
            return text, length
        ids = (got[:length] if len(got) > length
               else got + rng.integers(0, vocab_size, length - len(got)).tolist())
    return text, len(got)


def _fill_up(samples: list[Sample], n: int, what: str, rng: np.random.Generator
             ) -> list[Sample]:
    if not samples:
        raise ValueError(f"{what}: no usable prompt")
    if len(samples) < n:
        log.warning("%s has %d usable prompts; repeating some to make %d", what, len(samples), n)
        samples = samples + [samples[i] for i in rng.integers(0, len(samples), n - len(samples))]
    return samples[:n]


def sharegpt_samples(path: str | Path, n: int, tokenizer: TextTokenizer,
                     rng: np.random.Generator, output_len: int | None = None) -> list[Sample]:
    data = json.loads(Path(path).read_text())
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if len(c.get("conversations") or ()) >= 2]
    out: list[Sample] = []
    for i in rng.permutation(len(pairs)):
        if len(out) == n:
            break
        prompt, completion = pairs[i]
        p = len(tokenizer.encode(prompt))
        o = output_len if output_len is not None else len(tokenizer.encode(completion))
        if p < SHAREGPT_MIN_TOKENS or (output_len is None and o < SHAREGPT_MIN_TOKENS):
            continue
        if p > SHAREGPT_MAX_PROMPT or p + o > SHAREGPT_MAX_TOTAL:
            continue
        out.append(Sample(prompt, p, o))
    return _fill_up(out, n, str(path), rng)


def custom_samples(path: str | Path, n: int, tokenizer: TextTokenizer,
                   rng: np.random.Generator, output_len: int) -> list[Sample]:
    rows = []
    for k, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{k}: every line needs a string 'prompt'")
            rows.append(row)
    out = [Sample(r["prompt"], len(tokenizer.encode(r["prompt"])),
                  int(r.get("output_tokens") or output_len))
           for r in (rows[i] for i in rng.permutation(len(rows))[:n])]
    return _fill_up(out, n, str(path), rng)


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator
                  ) -> list[float]:
    """Seconds from the start at which each request is sent."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    times = np.cumsum(rng.gamma(burstiness, 1 / (rate * burstiness), n))
    return (times * (n / rate) / times[-1]).tolist()


def as_trace(samples: list[Sample], arrivals: list[float]
             ) -> tuple[list[TraceRequest], dict[str, list[int] | str]]:
    """The harness's trace requests and their prompts by request id."""
    trace = [TraceRequest(str(i), at, s.prompt_len, s.output_len)
             for i, (s, at) in enumerate(zip(samples, arrivals))]
    return trace, {t.request_id: s.prompt for t, s in zip(trace, samples)}

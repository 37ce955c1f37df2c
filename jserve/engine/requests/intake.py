"""The edge of the engine: a prompt (text or ids) and sampling parameters become a
``PreparedRequest`` after every check that could refuse it, before any state changes. The
serving front ends prepare on their side and hand the result over, so nothing is tokenized
or validated twice. No JAX here: the fake engine (``jserve.serving.fake_engine``) runs the
same intake, so its refusals are the engine's."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jserve.cache.allocator import PageAllocator
from jserve.fields import FieldError
from jserve.sampling.params import SamplingParams
from jserve.sampling.structured import GrammarCompiler
from jserve.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    prompt: str | None  # the text when the prompt came as text
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)


class RequestIntake:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 allocator: PageAllocator, eos_ids: tuple[int, ...] = (),
                 no_prompt_logprobs: str | None = None, adapters=None):
        """``no_prompt_logprobs``: what this engine runs on that computes no prompt logprobs
        (requests asking for them are refused, naming it); None: they are supported.
        ``adapters``: the LoRA adapters requests may name (``jserve.lora.slots``; None:
        none)."""
        self.adapters = adapters
        self.tokenizer = tokenizer
        self.no_prompt_logprobs = no_prompt_logprobs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.allocator = allocator
        # Structured output: grammars compile here, in ``prepare`` (the caller's thread, a
        # server's intake threads), so the engine thread only copies a cached one.
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_ids)

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                adapter: str | None = None) -> PreparedRequest:
        """Tokenized and validated; ``FieldError`` says which field is wrong and why."""
        params = params if params is not None else SamplingParams()
        if adapter is not None:
            if self.adapters is None:
                raise FieldError("model", f"{adapter!r}: this engine serves no LoRA adapters "
                                          "(start it with --enable-lora)")
            self.adapters.check(adapter)
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        return PreparedRequest(text, ids, params, adapter)

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True
                 ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise FieldError("prompt", "prompt is empty")
            if self.tokenizer is None:
                raise FieldError("prompt", "this model has no tokenizer: pass the prompt as "
                                           "token ids")
            if not add_special_tokens:  # (``/tokenize``'s option; a request always adds them)
                return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise FieldError("prompt", "prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise FieldError("prompt", f"prompt token ids outside the vocabulary "
                                       f"[0, {self.vocab_size}): {bad[:5]}")
        return None, ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate(vocab_size=self.vocab_size)
        if params.prompt_logprobs is not None and self.no_prompt_logprobs is not None:
            raise FieldError("prompt_logprobs",
                             f"prompt_logprobs is not supported with {self.no_prompt_logprobs}")
        if params.sequences > 1:  # ``LLM.generate`` and the HTTP API run n, one a request
            raise FieldError("n", f"n={params.n}, best_of={params.best_of}: the engine runs one "
                             "sequence per request (LLM.generate runs several of a prompt)")
        if params.structured_output is not None:
            if self.tokenizer is None:
                raise FieldError("structured_output",
                                 "structured_output needs a model with a tokenizer")
            self.grammars.check(params.structured_output)  # FieldError if invalid
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise FieldError("prompt",
                             f"prompt has {n} tokens; the context holds {self.max_model_len}")
        if n + params.max_tokens > self.max_model_len:
            raise FieldError("max_tokens", f"max_tokens ({params.max_tokens}) + prompt ({n} "
                                           f"tokens) exceeds the context of {self.max_model_len} "
                                           "tokens")
        alloc = self.allocator
        need = alloc.pages_held(n + params.max_tokens)  # a sliding window's: about one
        if not alloc.can_ever_hold(need):
            raise FieldError("prompt", f"request needs {need} KV pages; the pool has {alloc.total}"
                             + (f" ({alloc.groups} groups of {alloc.pool_pages - 1})"
                                if alloc.groups > 1 else ""))

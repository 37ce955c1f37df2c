"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``chat(messages)``,
the shape vLLM users know (vLLM's constructor names too: ``jserve.flags.vllm_names``).

A prompt's ``n`` sequences (``best_of`` of them run, the ``n`` of highest cumulative logprob
returned) are engine requests of their own, grouped back into one ``RequestOutput``. With a
request seed, sequence ``i`` samples with ``(seed + i) mod 2**32`` (as the HTTP API's choice
``i``); without one, each draws its own seed from the engine's generator. Greedy sequences
are identical (as in vLLM).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

from jserve.config import model_dir
from jserve.engine.build.startup import StartupTimes
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.engine.requests.intake import PreparedRequest
from jserve.engine.requests.output import RequestOutput
from jserve.flags.vllm_names import llm_engine_kwargs, separate_tokenizer
from jserve.lora.config import LoRARequest
from jserve.model.weights import load_model
from jserve.pooling import (
    POOLED,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingSpec,
    ScoringOutput,
    ScoringRequestOutput,
    finish,
    pairs,
    read_spec,
    score,
    unserved,
)
from jserve.probe.length_probe import default_probe_path
from jserve.sampling.generation_config import generation_defaults
from jserve.sampling.params import SamplingParams
from jserve.scheduler.registry import POLICIES
from jserve.serving.tool_calls import template_messages
from jserve.tokenizer import chat_prompt_ids

# A prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
Prompt = str | Sequence[int] | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    """Loads a model (``"default"``, an HF directory or an orbax directory) and serves batches.

    Engine settings are keyword arguments named as in ``EngineConfig`` (``seed`` seeds the
    draws for requests that bring no seed of their own; the default model's weights are fixed).
    ``quantization`` (none | int8 | fp8) quantizes the layer weights on load
    (docs/quantization.md); the KV cache's storage is the engine setting ``kv_cache_dtype``.
    vLLM's names are taken too (``tensor_parallel_size``, ``gpu_memory_utilization``,
    ``kv_cache_dtype="fp8"``, ``tokenizer``, ``trust_remote_code``: ``llm_engine_kwargs``);
    a name vLLM has and jserve refuses, or an unknown one, raises TypeError naming it.
    ``generation_config`` ("auto": the model directory's generation_config.json, "vllm":
    none, or a directory) and ``override_generation_config`` give the sampling defaults of
    ``generate`` and ``chat`` called without params (``get_default_sampling_params``).
    """

    def __init__(self, model: str = "default", *, dtype: str | None = None,
                 quantization: str | None = None, generation_config: str = "auto",
                 override_generation_config: dict | None = None, **engine_kwargs):
        startup = StartupTimes()  # imports: process start to here
        if "tpot_slo" in engine_kwargs:  # the iteration budget's name before
            warnings.warn("LLM(tpot_slo=...) is deprecated: use iteration_budget=...",
                          DeprecationWarning, stacklevel=2)
            engine_kwargs["iteration_budget"] = engine_kwargs.pop("tpot_slo")
        self.sampling_defaults = generation_defaults(
            generation_config, model_dir(model), override_generation_config)
        tokenizer = engine_kwargs.get("tokenizer")  # checked and dropped from the engine's
        engine_kwargs = llm_engine_kwargs(model, engine_kwargs)
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - fields)
        if unknown:
            raise TypeError(f"unknown LLM arguments {unknown}; "
                            f"engine settings are {sorted(fields)}")
        scheduler = POLICIES.get(engine_kwargs.get("scheduler", ""))
        if scheduler is not None and scheduler.length_probe \
                and not engine_kwargs.get("length_probe"):
            shipped = default_probe_path(model)  # a built-in model's trained length probe
            if shipped is not None:
                engine_kwargs["length_probe"] = str(shipped)
        if engine_kwargs.get("runner") == "pooling":  # the checkpoint's pooling, fields
            # of a pooler_config dict over it (vLLM's --pooler-config)
            given = engine_kwargs.get("pooler_config")
            engine_kwargs["pooler_config"] = given if isinstance(given, PoolingSpec) else \
                PoolingSpec.of({**dataclasses.asdict(read_spec(model_dir(model))),
                                **(given or {})})
        cfg, params, tokenizer = load_model(
            model, dtype=dtype, lazy=True, quantization=quantization,
            tokenizer=tokenizer if separate_tokenizer(tokenizer, model) else None)
        self.model = model
        self.engine = LLMEngine(cfg, params, tokenizer, EngineConfig(**engine_kwargs),
                                startup)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no params: the model's defaults
        (``generation_config``), else ``SamplingParams()``'s."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's name; None for a model without one)."""
        return self.tokenizer

    def chat_prompt(self, messages: Messages, tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of chat messages (OpenAI's format, as the HTTP chat endpoint takes
        them) under the tokenizer's chat template: one BOS, as transformers'
        ``apply_chat_template(tokenize=True)`` (``chat_prompt_ids``)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message, so it "
                             "cannot go with add_generation_prompt=True")
        return chat_prompt_ids(self.tokenizer, template_messages(messages), tools,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               template_kwargs=chat_template_kwargs)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or a list of them,
        each rendered by ``chat_prompt`` and generated as ``generate`` does (with
        ``lora_request`` as there). A per-call
        ``chat_template`` is refused (the tokenizer's is used; ``jserve serve
        --chat-template`` replaces it for a server)."""
        if chat_template is not None:
            raise ValueError("chat_template: a per-call chat template is not supported by "
                             "jserve; the tokenizer's template is used")
        one = bool(messages) and isinstance(messages[0], dict)
        prompts = [self.chat_prompt(m, tools, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs)
                   for m in ([messages] if one else messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion and returns one output per prompt, in prompt
        order, its ``n`` sequences in ``outputs`` (``use_tqdm``: vLLM's progress bar, which
        jserve does not draw). ``lora_request``: the LoRA adapter of every prompt, or one
        per prompt (None: the base model; ``enable_lora=True``).

        All prompts are validated before any is queued: a bad one raises ValueError naming
        its index and leaves the engine as it was.
        """
        if self.engine.pooler is not None:
            raise ValueError("this LLM makes embeddings (runner='pooling'): call embed()")
        prompts = _prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts")
        groups = self._prepare(prompts, params, loras)
        ids = [[self.engine.enqueue(r) for r in group] for group in groups]
        done = self._run({i for group in ids for i in group})
        return [_best([done[i] for i in group], p) for group, p in zip(ids, params)]

    def embed(self, prompts: Prompt | Sequence[Prompt], *, dimensions: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed`` (``runner="pooling"``): each prompt's embedding
        (``outputs.embedding``), pooled and normalized as the checkpoint says
        (``jserve.pooling``), its first ``dimensions`` entries where the model allows
        shorter ones (Matryoshka). Prompts are checked before any is queued."""
        spec = self._pooling(scores=False)
        if dimensions is not None:
            why = spec.check_dimensions(dimensions, self.engine.model_config.hidden_size)
            if why is not None:
                raise ValueError(why)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(
            finish(o.embedding, spec, dimensions).tolist()))
            for o in self._pooled(_prompts(prompts))]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` on a cross-encoder (a one-label sequence classifier,
        ``runner="pooling"``): each pair's score (``outputs.score``), one ``text_1`` with
        each ``text_2`` or each with its own (``pooling.pairs``)."""
        spec = self._pooling(scores=True)
        prompts = [self.tokenizer.encode_pair(a, b) for a, b in pairs(text_1, text_2)]
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(
            score(o.embedding, spec))) for o in self._pooled(prompts)]

    def _pooling(self, scores: bool) -> PoolingSpec:
        """The engine's pooling, or ValueError if it cannot give embeddings (``scores``:
        scores; ``pooling.unserved``)."""
        pooler = self.engine.pooler
        why = unserved(pooler and pooler.spec, self.engine.model_config.num_labels, scores)
        if why is not None:
            raise ValueError(f"this LLM cannot {'score' if scores else 'embed'}: {why}")
        return pooler.spec

    def _pooled(self, prompts: list) -> list[RequestOutput]:
        """Each prompt's finished output, pooled (all checked before any is queued)."""
        groups = self._prepare(prompts, [POOLED] * len(prompts))
        ids = [self.engine.enqueue(group[0]) for group in groups]
        done = self._run(set(ids))
        return [done[i] for i in ids]

    def _run(self, wanted: set[str]) -> dict[str, RequestOutput]:
        """Steps the engine until every request in ``wanted`` finished; their outputs."""
        done: dict[str, RequestOutput] = {}
        while wanted - done.keys():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return done

    def _prepare(self, prompts: list, params: list[SamplingParams],
                 loras: list[LoRARequest | None] | None = None) -> list[list[PreparedRequest]]:
        """Each prompt's sequences, prepared (tokenized and checked once per prompt)."""
        groups = []
        loras = loras or [None] * len(prompts)
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
            seqs = [_sequence_params(p, j) for j in range(p.sequences)]
            try:
                first = self.engine.prepare(prompt, seqs[0], lora)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            groups.append([first] + [dataclasses.replace(first, params=q) for q in seqs[1:]])
        return groups


def _prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | Sequence[int]]:
    """One prompt or a list of them, as texts or ids."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [_prompt(p) for p in prompts]


def _prompt(p: Prompt) -> str | Sequence[int]:
    """A prompt as text or ids (vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``)."""
    if not isinstance(p, dict):
        return p
    if set(p) == {"prompt"} or set(p) == {"prompt_token_ids"}:
        return next(iter(p.values()))
    raise TypeError(f"a dict prompt takes 'prompt' or 'prompt_token_ids' alone, got {sorted(p)}")


def _sequence_params(p: SamplingParams, i: int) -> SamplingParams:
    """Sequence ``i``'s own request params: one sequence, seed ``seed + i``, and the chosen
    tokens' logprobs when ``best_of`` > ``n`` ranks by them (``_best`` hides them again
    unless asked for)."""
    if p.sequences == 1 and p.best_of is None:
        return p
    ranks = p.sequences > p.n and p.logprobs is None
    return dataclasses.replace(
        p, n=1, best_of=None, seed=None if p.seed is None else (p.seed + i) % 2**32,
        logprobs=0 if ranks else p.logprobs)


def _best(seqs: list[RequestOutput], p: SamplingParams) -> RequestOutput:
    """A prompt's output: its sequences, or with ``best_of`` > ``n`` the ``n`` of highest
    cumulative logprob, best first (ties: the earlier sequence), logprobs dropped unless
    asked for."""
    if p.sequences > p.n:
        seqs = sorted(seqs, key=lambda s: -sum(lp.logprob for lp in s.logprobs))[:p.n]
        if p.logprobs is None:
            seqs = [dataclasses.replace(s, _logprobs=None) for s in seqs]
    return RequestOutput.group(seqs)

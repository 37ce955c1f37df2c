"""The offline API: ``LLM(model=...).generate(prompts, params)``, the shape vLLM users know."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.engine.output import RequestOutput
from jserve.engine.startup import StartupTimes
from jserve.model.weights import load_model
from jserve.probe.length_probe import default_probe_path
from jserve.sampling.params import SamplingParams
from jserve.scheduler.registry import POLICIES
from jserve.tokenizer import chat_prompt_ids

Prompt = str | Sequence[int]


class LLM:
    """Loads a model (``"default"``, an HF directory or an orbax directory) and serves batches.

    Engine settings are keyword arguments named as in ``EngineConfig`` (``seed`` seeds the
    draws for requests that bring no seed of their own; the default model's weights are fixed).
    ``quantization`` (none | int8 | fp8) quantizes the layer weights on load
    (docs/quantization.md); the KV cache's storage is the engine setting ``kv_cache_dtype``.
    """

    def __init__(self, model: str = "default", *, dtype: str | None = None,
                 quantization: str | None = None, **engine_kwargs):
        startup = StartupTimes()  # imports: process start to here
        if "tpot_slo" in engine_kwargs:  # the iteration budget's name before
            warnings.warn("LLM(tpot_slo=...) is deprecated: use iteration_budget=...",
                          DeprecationWarning, stacklevel=2)
            engine_kwargs["iteration_budget"] = engine_kwargs.pop("tpot_slo")
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
        cfg, params, tokenizer = load_model(model, dtype=dtype, lazy=True,
                                            quantization=quantization)
        self.model = model
        self.engine = LLMEngine(cfg, params, tokenizer, EngineConfig(**engine_kwargs),
                                startup)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of chat messages under the tokenizer's chat template (one BOS, as
        transformers' ``apply_chat_template(tokenize=True)``; ``chat_prompt_ids``)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        return chat_prompt_ids(self.tokenizer, messages, tools)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion and returns outputs in prompt order.

        All prompts are validated before any is queued (``LLMEngine.add_requests``): a bad one
        raises ValueError and leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = self.engine.add_requests(prompts, params)
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        while wanted - done.keys():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
        return [done[i] for i in ids]

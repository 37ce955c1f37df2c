"""jserve: a JAX/XLA serving stack for Llama-family models with preemptive scheduling.

``LLM``, ``SamplingParams``, ``RequestOutput`` and ``CompletionOutput`` (vLLM's names) load
on first use, so JAX-free parts (the scheduler, the simulator) import without pulling in JAX.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"LLM": "jserve.llm", "SamplingParams": "jserve.sampling.params",
            "RequestOutput": "jserve.engine.requests.output",
            "CompletionOutput": "jserve.engine.requests.output",
            "LoRARequest": "jserve.lora.config"}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jserve' has no attribute {name!r}")

"""Shared engine settings: small buckets so tests compile little, and the same settings
everywhere so the persistent compilation cache is shared between tests."""
from __future__ import annotations

import pytest

from jserve import LLM

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=512,
             warmup=False)


def small_llm(model: str = "default", **overrides) -> LLM:
    return LLM(model, **{**SMALL, **overrides})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return small_llm()

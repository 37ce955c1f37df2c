"""Engines built and dropped in one process (a sweep over settings) must not pile up compiled
executables: each holds hundreds of memory maps on CPU, and vm.max_map_count is finite."""
from __future__ import annotations

import gc

import pytest

from jserve import SamplingParams
from llm_helpers import small_llm

pytestmark = pytest.mark.slow


def _memory_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_six_engines_built_and_dropped_do_not_accumulate_memory_maps():
    counts = []
    for i in range(6):  # different settings each time, so nothing is shared between them
        llm = small_llm(max_num_seqs=2 + i % 3, max_model_len=256 + 16 * i,
                        compilation_cache_dir=None)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
        del llm, out
        gc.collect()
        counts.append(_memory_maps())
    # An engine whose resources outlive it leaves ~1,500 maps behind; allow noise, not growth.
    assert counts[-1] - counts[1] < 300, counts

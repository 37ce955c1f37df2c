"""Speculative decoding on meshes: with n-gram drafts, kvp=2 (a prompt and its drafts
crossing the KV-cache-parallel group boundary) and tp=2 give the one-device greedy tokens
without speculation; blocks conserved. One subprocess with 8 forced host devices."""
from __future__ import annotations

import json
import textwrap

import pytest

from devices import run_on_devices

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent("""
    import json, sys
    from jserve import LLM, SamplingParams
    from harness.evaluate import release_executables
    settings = json.loads(sys.argv[1])
    prompts = ["count down from 40", "list fruits", "count down from 33",
               "list fruits, then count down from 50 " * 3]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    result = {}
    for name, mesh, speculative in (("ref", "tp=1", None), ("kvp=2", "kvp=2", spec),
                                    ("tp=2", "tp=2", spec)):
        llm = LLM("tiny-tasks", mesh=mesh, speculative_config=speculative, **settings)
        outs = llm.generate(prompts, params)
        eng = llm.engine
        eng.allocator.check()
        result[name] = {"tokens": [o.token_ids for o in outs],
                        "leaked": eng.allocator.num_allocated,
                        "accepted": eng.scheduler.num_accepted_tokens,
                        "drafted": eng.scheduler.num_draft_tokens}
        del llm, eng, outs
        release_executables()
    print(json.dumps(result))
""")


def test_kvp2_and_tp2_with_drafts_match_one_device():
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                    max_model_len=160, warmup=False)
    result = run_on_devices(_SCRIPT, json.dumps(settings), timeout=1200).result
    ref = result["ref"]
    assert ref["drafted"] == 0
    for mesh in ("kvp=2", "tp=2"):
        got = result[mesh]
        assert got["tokens"] == ref["tokens"], mesh
        assert got["leaked"] == 0 and 0 < got["accepted"] < got["drafted"], mesh

"""Engine helpers for the tests that run the model (they import JAX; the scheduler and
simulator tests never import this module): small buckets so tests compile little, and the
same settings everywhere so the persistent compilation cache is shared between tests."""
from __future__ import annotations

import numpy as np

from jserve import LLM

SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2, max_model_len=512,
             warmup=False)


def small_llm(model: str = "default", **overrides) -> LLM:
    return LLM(model, **{**SMALL, **overrides})


def check_blocks(eng) -> None:
    """Blocks conserved and held exactly by running requests (a shared cached page once per
    holder), waiting requests hold none (a swapped windowed one keeps its dropped entries),
    exactly the swapped ones have a host copy."""
    eng.allocator.check()
    eng.allocator.check_holders(eng.scheduler.page_holders())
    assert all(not r.held_page_ids for r in eng.scheduler.waiting)
    assert set(eng.host_kv.copies) == {r.request_id for r in eng.scheduler.waiting if r.swapped}


def run_checked(llm: LLM, prompts, params) -> list[list[int]]:
    """Runs ``prompts`` to completion, checking after every step that blocks are conserved
    (held exactly by running requests, a shared cached page once per holder), waiting
    requests hold none, and exactly the swapped ones have a host copy; returns the output ids
    in prompt order. Plans land in ``llm.engine.step_log``."""
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step_log = []
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        check_blocks(eng)
    assert eng.allocator.num_allocated == 0
    return [done[i] for i in ids]


def assert_same_output(got, want) -> None:
    """Two runs' (token ids, [(token, logprob, top)]) of one request: the same tokens and
    top-k ids, logprobs within float32 noise."""
    assert got[0] == want[0]
    for (t1, l1, top1), (t2, l2, top2) in zip(got[1], want[1], strict=True):
        assert t1 == t2 and [t for t, _ in top1] == [t for t, _ in top2]
        np.testing.assert_allclose([l1, *(x for _, x in top1)], [l2, *(x for _, x in top2)],
                                   rtol=1e-5, atol=1e-5)

"""KV-cache parallelism in the live engine: in a subprocess with 8 forced host devices,
a kvp=4 engine gives the 1-device engine's greedy tokens on a workload
with a prompt spanning every group, decodes crossing group boundaries, chunked prefills and
swap preemptions under small per-group pools, and the group rules hold: chunks never cross a
boundary, sequences start on several groups. kvp=2, kvp x tp and kvp x spp with recompute
preemption are in the mesh matrix (tests/test_mesh_matrix.py)."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

from devices import run_on_devices

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from jserve import LLM, SamplingParams
    sys.path.insert(0, "tests")
    from llm_helpers import run_checked

    # max_model_len 256, pages of 16: L = 128 tokens per group at kvp=2, 64 at kvp=4.
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                    max_model_len=256, warmup=False)
    rng = np.random.default_rng(3)
    # 200 tokens (+12 decoded) spans both groups at kvp=2 and all four at kvp=4; 60 and 120
    # decode across the 64 and 128 boundaries.
    prompts = [rng.integers(0, 256, n).tolist() for n in (200, 5, 60, 120, 30, 90)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    page = 2 * 4 * 2 * 16 * 64 * 4          # bytes of one page on one device: 4 layers, 2 KV heads
    # (mesh, pages per group including the sink, bytes per page per device, preemption)
    cases = [("tp=1", None, page, "auto"), ("kvp=4", 6, page, "swap")]
    result = {}
    for mesh, pool, per_page, preemption in cases:
        kw = {} if pool is None else dict(kv_cache_bytes=pool * per_page)
        llm = LLM("default", mesh=mesh, preemption=preemption, **settings, **kw)
        eng = llm.engine
        ids = [eng.add_request(p, params) for p in prompts]
        outs = {}
        eng.step_log = []
        starts, spread = set(), 0
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o
            eng.allocator.check()
            eng.allocator.check_holders(eng.scheduler.page_holders())
            for r in eng.scheduler.running:
                if r.page_ids:
                    starts.add(eng.allocator.start_group(r.page_ids))
                    spread = max(spread, len({eng.allocator.group_of(b) for b in r.page_ids}))
        plans = [p for p, _ in eng.step_log]
        L = eng.allocator.tokens_per_group
        crossing = L is not None and any(c.start // L != (c.start + c.num_tokens - 1) // L
                                         for p in plans for c in p.prefills)
        # A decode writing the first token of a group's range (its KV goes to the next group).
        decode_cross = L is not None and any(c.start % L == 0 for p in plans for c in p.decodes)
        outs = [outs[i] for i in ids]
        result[mesh] = {
            "tokens": [o.token_ids for o in outs],
            "top": [[[lp for _, lp in t.top] for t in o.logprobs] for o in outs],
            "devices": len(eng.runner.kv_cache[0].sharding.device_set),
            "pages": int(eng.runner.kv_cache[0].shape[2]),
            "groups": eng.allocator.groups,
            "preemptions": eng.scheduler.num_preemptions, "swaps": eng.scheduler.num_swaps,
            "chunked": sum(1 for p in plans for c in p.prefills if not c.samples),
            "crossing": crossing, "starts": sorted(starts), "spread": spread,
            "decode_cross": decode_cross,
            "free": eng.allocator.num_free, "total": eng.allocator.total}
        del llm, eng
    print(json.dumps(result))
""")


def test_kvp_engine_matches_the_unsharded_engine():
    result = run_on_devices(_SCRIPT, timeout=900).result
    base = result["tp=1"]
    assert base["devices"] == 1 and base["groups"] == 1
    assert all(len(t) == 12 for t in base["tokens"])
    for mesh, devices, groups, pool in (("kvp=4", 4, 4, 6),):
        r = result[mesh]
        assert r["devices"] == devices and r["groups"] == groups, (mesh, r)
        assert r["pages"] == groups * pool and r["total"] == groups * (pool - 1), (mesh, r)
        assert r["tokens"] == base["tokens"], mesh
        np.testing.assert_allclose(np.array(r["top"]), np.array(base["top"]), atol=1e-4, rtol=0)
        assert r["preemptions"] > 0, (mesh, r)        # the small per-group pools were short
        assert r["chunked"] > 0 and not r["crossing"], (mesh, r)
        assert len(r["starts"]) > 1, (mesh, r)        # sequences started on several groups
        assert r["spread"] == groups and r["decode_cross"], (mesh, r)  # 200 tokens: all groups
        assert r["free"] == r["total"]
    assert result["kvp=4"]["swaps"] > 0

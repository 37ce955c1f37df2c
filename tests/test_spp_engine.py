"""Stream pipeline parallelism in the live engine against the one-device engine.

The multi-device runs happen in a subprocess that forces 8 host devices before JAX starts
(like tests/test_sharding.py). One script runs the reference and every mesh, checking after
every tick that KV pages are conserved (running requests plus blocks whose release waits for
in-flight chunks), and reports tokens, logprobs and what the pipeline held per tick."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from devices import run_on_devices
from jserve.cache.allocator import PageAllocator
from jserve.scheduler import Request, RequestStatus, SarathiScheduler
from llm_helpers import small_llm

_SCRIPT = textwrap.dedent("""
    import json, sys
    from jserve import LLM, SamplingParams
    settings = json.loads(sys.argv[1])
    LENGTHS = (70, 6, 45, 3, 33, 12)  # 70 and 45 take several 32-token chunks
    prompts = [list(range(3 + i, 3 + i + n)) for i, n in enumerate(LENGTHS)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    # Penalties (state updated as each batch leaves the pipeline) and seeded sampling too.
    mixed = [params] * len(prompts)
    mixed[1] = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2,
                              repetition_penalty=1.5, frequency_penalty=0.7)
    mixed[4] = SamplingParams(max_tokens=8, temperature=0.9, top_k=40, seed=7,
                              ignore_eos=True, logprobs=2)

    def check_blocks(eng):
        eng.allocator.check()
        sched = eng.scheduler
        held = sum(len(r.page_ids) for r in sched.running)
        deferred = sum(len(b) for b in sched._deferred.values())
        assert eng.allocator.num_allocated == held + deferred, (eng.allocator.num_allocated,
                                                                 held, deferred)
        assert all(not r.page_ids for r in sched.waiting)

    def drain(eng, done):
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
            check_blocks(eng)
        assert eng.allocator.num_allocated == 0 and not eng.scheduler._deferred
        assert not eng.scheduler.pinned and not eng.scheduler.in_flight

    def run(mesh):
        llm = LLM("default", mesh=mesh, **settings)
        eng = llm.engine
        eng.pipeline_log = []
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, mixed)]
        done = {}
        drain(eng, done)
        outs = [done[i] for i in ids]
        return {"tokens": [o.token_ids for o in outs],
                "top": [[[lp for _, lp in t.top] for t in o.logprobs] for o in outs],
                "preemptions": eng.scheduler.num_preemptions,
                "log": eng.pipeline_log,
                "devices": len(eng.runner.params["embed"].sharding.device_set),
                # what one device holds: stage-local layers and pages
                # [stage layers, KV heads / tp, pages, page, head_dim]
                "kv_shard": list(eng.runner.kv_cache[0].addressable_shards[0].data.shape),
                # [stage layers, hidden, (q + k + v heads) / tp]: under spp each stage's layers as
                # separate [1, ...] shards (unstack_stages), stacked with layer_loop="loop"
                # (one device may run the unrolled per-layer form)
                "wqkv_shard": wqkv_shard(eng.runner.params["layers"])}

    def wqkv_shard(layers):
        if isinstance(layers, tuple):
            shards = [list(layer["wqkv"].addressable_shards[0].data.shape) for layer in layers]
            assert all(s[0] == 1 for s in shards), shards
            return [len(shards)] + shards[0][1:]
        if isinstance(layers, dict):
            return list(layers["wqkv"].addressable_shards[0].data.shape)
        return None

    def run_abort():
        # Abort a long prompt while one of its chunks is in the pipeline; its id is reused
        # at once by a new request, which must get its own tokens (not the aborted one's).
        llm = LLM("default", mesh="spp=2", **settings)
        eng = llm.engine
        a = eng.add_request(prompts[0], params, request_id="a")
        b = eng.add_request(prompts[3], params, request_id="b")
        done = {}
        eng.step()
        check_blocks(eng)
        req = eng.requests["a"]
        assert req in eng.scheduler.pinned and req.num_computed > 0, req.num_computed
        before = eng.allocator.num_allocated
        blocks = len(req.page_ids)
        eng.abort("a")
        check_blocks(eng)
        deferred_kept = eng.allocator.num_allocated == before and blocks > 0
        eng.add_request(prompts[2], params, request_id="a")
        drain(eng, done)
        return {"deferred_kept": deferred_kept, "a": done["a"].token_ids,
                "b": done["b"].token_ids}

    result = {mesh: run(mesh) for mesh in ("tp=1", "spp=2", "spp=4", "spp=2,tp=2")}
    result["abort"] = run_abort()
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def result():
    # A 10-page pool (9 usable 16-token blocks) forces preemptions on this workload.
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_prefill_seqs": 2,
                "max_model_len": 512, "warmup": False, "num_kv_pages": 10}
    return run_on_devices(_SCRIPT, json.dumps(settings), timeout=900).result


@pytest.mark.slow
@pytest.mark.parametrize("mesh, spp, devices", [("spp=2", 2, 2), ("spp=4", 4, 4),
                                                 ("spp=2,tp=2", 2, 4)])
def test_pipeline_matches_one_device_engine(result, mesh, spp, devices):
    """Tokens identical to the unsharded engine (greedy, penalised greedy and seeded
    sampling), top logprobs within float32 rounding, on multi-chunk prefills, decodes and
    preemptions (both runs preempt)."""
    base, run = result["tp=1"], result[mesh]
    assert base["devices"] == 1 and run["devices"] == devices
    assert all(len(t) == 8 for t in base["tokens"])
    assert base["preemptions"] >= 1 and run["preemptions"] >= 1
    assert run["tokens"] == base["tokens"]
    layers, tp = 4, devices // spp
    assert base["kv_shard"][0] == layers
    assert run["kv_shard"][:2] == [layers // spp, base["kv_shard"][1] // tp]
    assert run["wqkv_shard"] == [layers // spp, 256, 512 // tp]  # 4 + 2 + 2 heads of 64
    np.testing.assert_allclose(np.array(run["top"]), np.array(base["top"]), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, spp", [("spp=2", 2), ("spp=4", 4), ("spp=2,tp=2", 2)])
def test_pipeline_keeps_spp_batches_in_flight(result, mesh, spp):
    log = result[mesh]["log"]
    assert all(len(tick["stages"]) <= spp for tick in log)
    assert max(tick["in_flight"] for tick in log) == spp
    # A non-sampling prefill chunk lets the next chunk of the same request enter stage 0
    # while it is still on stage 1.
    follows = [tick for tick in log if len(tick["stages"]) > 1 and any(
        rid == rid0 and start + n == start0 and not samples
        for rid0, start0, _, _ in tick["stages"][0]
        for rid, start, n, samples in tick["stages"][1])]
    assert follows
    # A chunk that samples is its request's only chunk in the pipeline: the next one (its
    # decode) enters after the token left the last stage.
    for tick in log:
        for s, batch in enumerate(tick["stages"]):
            for rid, _, _, samples in batch:
                if samples:
                    others = [r for stage in tick["stages"][:s] for r, _, _, _ in stage]
                    assert rid not in others, (tick, rid)


@pytest.mark.slow
def test_abort_in_flight_defers_block_release(result):
    """Aborting a request whose chunk is in the pipeline keeps its blocks until the chunk
    is out, then frees them (no leak: checked in the script); the id reused at once gets
    its own tokens, and the other request is unaffected."""
    base, run = result["tp=1"], result["abort"]
    assert run["deferred_kept"]
    assert run["a"] == base["tokens"][2]
    assert run["b"] == base["tokens"][3]


def test_spp_must_divide_the_layers():
    with pytest.raises(ValueError, match="spp=3 does not divide num_hidden_layers=4"):
        small_llm(mesh="spp=3")


# -- scheduler pinning (pure Python, constructed cases) -----------------------------------
def _pinning_case():
    """a (8 tokens) and b (20) under a 4-block pool of 4-token blocks: plan 1 prefills a
    (sampling) and the first 8 tokens of b and comes back; b is pinned as if its next chunk
    were in the pipeline, and a needs a third block for its next token."""
    s = SarathiScheduler(PageAllocator(5, 4), max_num_seqs=8, max_num_batched_tokens=64,
                         max_prefill_seqs=4)
    a = Request("a", list(range(1, 9)), 8, 0.0)
    b = Request("b", list(range(1, 21)), 8, 1.0)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(c.request_id, c.num_tokens, c.samples) for c in plan.prefills] == [
        ("a", 8, True), ("b", 8, False)]
    s.update(plan, [5])  # a's token is out ...
    s.pinned[b] = 1      # ... and b's next chunk as if still in a pipeline stage
    return s, a, b


def test_pinned_request_is_never_the_preemption_victim():
    s, a, b = _pinning_case()
    blocks = list(b.page_ids)
    plan = s.schedule()
    # Unpinned, b (the latest arrival) would be the victim; pinned, a yields instead and b
    # continues with its next chunk while its previous one is in flight.
    assert plan.preempted == ("a",) and a.status is RequestStatus.PREEMPTED
    assert [(c.request_id, c.start, c.num_tokens) for c in plan.prefills] == [("b", 8, 8)]
    assert b.page_ids[:2] == blocks
    s.allocator.check()


def test_all_pinned_means_an_empty_plan_not_a_preemption():
    s, a, b = _pinning_case()
    s.pinned[a] = 1
    plan = s.schedule()
    assert plan.is_empty and plan.preempted == ()
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.RUNNING


def test_finish_while_pinned_defers_the_block_release():
    s, a, b = _pinning_case()
    s.pinned[b] += 1  # two chunks of b in flight
    held = s.allocator.num_allocated
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert s.allocator.num_allocated == held and not b.page_ids and b not in s.running
    s._unpin(b)
    assert s.allocator.num_allocated == held  # one chunk still in flight
    s._unpin(b)
    assert s.allocator.num_allocated == held - 2 and b not in s.pinned
    s.allocator.check()

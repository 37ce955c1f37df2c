"""The LoongServe-like baseline: non-preemptive FCFS prefills, an ESP degree from the prompt
length, and that degree shortening predicted prefill time."""
from __future__ import annotations

import pytest

from jserve.cache.allocator import BlockAllocator
from jserve.scheduler.loongserve import LoongServeScheduler, esp_degree
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request
from jserve.sim import GpuTimeModel, TraceRequest, VirtualClock, simulate
from jserve.sim.esp import EspTimeModel

MS_PER_TOKEN = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))


def loongserve(num_instances=2, tokens_per_instance=4096, token_cap=1000, efficiency=0.9,
               instance=MS_PER_TOKEN):
    sched = LoongServeScheduler(BlockAllocator(4097, 16), num_instances=num_instances,
                                tokens_per_instance=tokens_per_instance, max_num_seqs=16,
                                max_num_batched_tokens=token_cap, max_prefill_seqs=4)
    return sched, EspTimeModel(instance, num_instances, sched.degree_of, efficiency)


def test_esp_degree_grows_with_length_up_to_the_instances():
    assert [esp_degree(n, 8, 65_536) for n in (1, 65_536, 65_537, 200_000, 300_000,
                                               10_000_000)] == [1, 1, 2, 4, 8, 8]
    assert esp_degree(1_000_000, 2, 65_536) == 2
    assert esp_degree(1_000_000, 1, 65_536) == 1


def test_a_short_arriving_during_a_long_prefill_waits_for_all_of_it():
    sched, model = loongserve()
    trace = [TraceRequest("long", 0.0, 10_000, 2), TraceRequest("short", 1.0, 500, 2)]
    recs = {r["request_id"]: r for r in simulate(sched, model, VirtualClock(), trace,
                                                 "loongserve")}
    # The long prefill (ESP 2 of 2 instances at 90%): ten 1000-token iterations of 1 / 1.8 s.
    long_prefill = 10 * 1.0 / (2 * 0.9)
    assert recs["long"]["first_token_s"] == pytest.approx(long_prefill)
    # The short started only after it, on one instance beside the long request's decode.
    assert recs["short"]["first_token_s"] == pytest.approx(long_prefill + 0.5)
    assert sched.allocator.num_allocated == 0


def test_no_prefill_overtakes_and_finished_heads_let_the_next_join_an_iteration():
    sched = LoongServeScheduler(BlockAllocator(4097, 16), num_instances=2, max_num_seqs=16,
                                max_num_batched_tokens=1000, max_prefill_seqs=4)
    reqs = [Request(name, [0] * n, 1, 0.0) for name, n in
            (("a", 1500), ("b", 300), ("c", 100), ("d", 2000))]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("a", 1000)]
    reqs[0].num_computed = 1000
    plan = sched.schedule()
    # a finishes with 500, then b (300) and c (100) fit whole; d starts with what is left.
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [
        ("a", 500), ("b", 300), ("c", 100), ("d", 100)]
    for c in plan.prefills:
        next(r for r in reqs if r.request_id == c.request_id).num_computed += c.num_tokens
    plan = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("d", 1000)]


def test_esp_shortens_a_long_prefill_and_decodes_use_free_instances():
    instance = GpuTimeModel("llama3-8b", "a100", tp=8)
    sched, model = loongserve(num_instances=4, tokens_per_instance=65_536, instance=instance)
    long, short = Request("long", [0] * 300_000, 1, 0.0), Request("short", [0] * 2000, 1, 0.0)
    sched.add(long)
    sched.add(short)
    assert sched.degree_of("long") == 4 and sched.degree_of("short") == 1
    chunk = BatchPlan((), (ScheduledChunk("long", 200_000, 8192, False),))
    alone = instance.predict(chunk)
    assert model.predict(chunk) == pytest.approx(alone / (4 * 0.9))
    short_chunk = BatchPlan((), (ScheduledChunk("short", 0, 2000, True),))
    assert model.predict(short_chunk) == pytest.approx(instance.predict(short_chunk))
    # Decodes beside a 1-instance prefill run on the 3 free instances, in parallel with it.
    decodes = tuple(ScheduledChunk(f"d{i}", 4000, 1, True) for i in range(30))
    mixed = BatchPlan(decodes, short_chunk.prefills)
    assert model.predict(mixed) == pytest.approx(max(
        instance.predict(short_chunk), instance.predict(BatchPlan(decodes[::3], ()))))
    # Beside an all-instance prefill they queue behind it: the times add.
    mixed = BatchPlan(decodes, chunk.prefills)
    assert model.predict(mixed) == pytest.approx(
        alone / 3.6 + instance.predict(BatchPlan(decodes[::4], ())))

"""The simulator's driver: length-only requests, pipelined issue (SPP), the run window, and the
GPU time model's fast paths agreeing with its plain answers."""
from __future__ import annotations

import math
import random
import tracemalloc

import pytest

from jserve.bench.metrics import percentile, summarize
from jserve.cache.allocator import PageAllocator
from jserve.scheduler.chunking import PrefillTimeCache
from jserve.scheduler.deadline import DeadlineConfig, DeadlineScheduler
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import LinearPredictor
from jserve.scheduler.request import Request
from jserve.scheduler.sarathi import SarathiScheduler
from jserve.sim import GpuTimeModel, LengthOnlyTokens, TraceRequest, VirtualClock, simulate
from jserve.sim.hardware import StageTimes
from jserve.sim.policies import SimConfig, _prefill_cache, pipeline_drain

MS_PER_TOKEN = LinearPredictor((0.0, 1e-3, 0.0, 0.0, 0.0, 0.0))


class TwoStagePipeline:
    """2 ms a token through both stages, a new batch every 1 ms a token (two stages)."""

    def predict(self, plan: BatchPlan) -> float:
        return 2e-3 * plan.num_tokens

    def stage_time(self, plan: BatchPlan) -> float:
        return 1e-3 * plan.num_tokens


def fcfs(predictor, blocks: int = 4096, page_size: int = 16, token_cap: int = 100):
    clock = VirtualClock()
    sched = DeadlineScheduler(
        PageAllocator(blocks + 1, page_size), policy="fcfs", predictor=predictor,
        prefill_cache=PrefillTimeCache(MS_PER_TOKEN, 4096, 0.05), max_num_seqs=8,
        max_num_batched_tokens=token_cap, max_prefill_seqs=4, clock=clock)
    return sched, clock


def test_length_only_tokens_behave_like_a_list_of_zeros():
    t = LengthOnlyTokens(5)
    assert len(t) == 5 and t and not LengthOnlyTokens(0)
    t.append(7)
    t.extend([1, 2])
    assert len(t) == 8 and t[7] == 0 and list(t[6:]) == [0, 0]
    assert len(t[3:]) == 5 and len(t[10:]) == 0 and len(t[::2]) == 4
    with pytest.raises(IndexError):
        t[8]
    req = Request("r", LengthOnlyTokens(4), 3, 0.0, all_token_ids=LengthOnlyTokens(4))
    req.all_token_ids.append(0)
    assert req.num_prompt_tokens == 4 and req.num_output_tokens == 1
    assert len(req.output_token_ids) == 1 and req.num_uncomputed == 5


def test_a_million_token_prompt_costs_constant_memory():
    sched, clock = fcfs(MS_PER_TOKEN, blocks=1100, page_size=1024, token_cap=65_536)
    trace = [TraceRequest("big", 0.0, 1_000_000, 3), TraceRequest("small", 1.0, 100, 2)]
    tracemalloc.start()
    records = simulate(sched, MS_PER_TOKEN, clock, trace, "fcfs")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000  # a list of 1M token ids alone would be 8 MB
    big, small = records
    assert big["first_token_s"] == pytest.approx(1000.0)  # 1 ms a token, whole prompt first
    assert big["output_tokens"] == 3 and big["finish_reason"] == "length"
    assert small["first_token_s"] > big["first_token_s"]  # fcfs: it waited behind the prompt
    assert sched.allocator.num_allocated == 0


def test_pipelined_prefill_chunks_issue_one_stage_apart_and_tokens_arrive_after_latency():
    trace = [TraceRequest("r", 0.0, 1000, 3)]
    piped, clock = fcfs(TwoStagePipeline())
    rec = simulate(piped, TwoStagePipeline(), clock, trace, "fcfs")[0]
    # Ten 100-token chunks issued 0.1 s apart; the last one's token arrives 0.2 s after 0.9.
    assert rec["first_token_s"] == pytest.approx(1.1)
    # Each decode waits for the previous token: one full latency (2 ms) per token.
    assert rec["finish_s"] == pytest.approx(1.104)
    serial, clock = fcfs(TwoStagePipeline())
    rec = simulate(serial, TwoStagePipeline(), clock, trace, "fcfs",
                   stage_time=TwoStagePipeline().predict)[0]
    assert rec["first_token_s"] == pytest.approx(2.0)


def test_remaining_work_counts_the_pipelines_last_pass():
    """On a two-stage pipeline a prompt's chunks issue one stage time apart but its first
    token leaves one latency after the last issue: the scheduler's remaining work (stage
    times summed, plus the drain) is the simulated isolated TTFT."""
    pipe = TwoStagePipeline()

    class Stages:  # the pipeline's issue intervals, as jserve.sim.hardware.StageTimes
        predict = staticmethod(pipe.stage_time)

    drain = 0.05 / 2  # a batch filling the 50 ms latency budget: 25 tokens, 25 ms a stage
    cache = PrefillTimeCache(Stages(), 4096, 0.05 / 2, chunk_granularity=1, drain_s=drain)
    clock = VirtualClock()
    sched = DeadlineScheduler(
        PageAllocator(257, 16), policy="lars", predictor=pipe, prefill_cache=cache,
        max_num_seqs=8, max_num_batched_tokens=1000, max_prefill_seqs=4, clock=clock,
        config=DeadlineConfig(chunk_granularity=1))
    req = Request("r", [0] * 100, 1, 0.0)
    assert sched.remaining_work(req) == pytest.approx(0.1 + drain)
    assert cache.remaining(100, 100) == 0.0 and cache.remaining(100, 75) == pytest.approx(
        0.025 + drain)
    rec = simulate(sched, pipe, clock, [TraceRequest("r", 0.0, 100, 1)], "lars")[0]
    # Four 25-token chunks issued 25 ms apart; the last one's token 50 ms after 0.075.
    assert rec["first_token_s"] == pytest.approx(0.125) == pytest.approx(0.1 + drain)


def test_a_decode_in_flight_is_not_rescheduled_while_another_prefill_streams():
    trace = [TraceRequest("a", 0.0, 100, 3), TraceRequest("b", 0.05, 1000, 1)]
    sched, clock = fcfs(TwoStagePipeline())
    recs = {r["request_id"]: r for r in simulate(sched, TwoStagePipeline(), clock, trace,
                                                 "fcfs")}
    # a's 3 tokens each need a round trip of the pipeline: at least 2 x its batch latency apart.
    a = recs["a"]
    assert a["output_tokens"] == 3
    assert (a["finish_s"] - a["first_token_s"]) / 2 >= 2e-3 * 2
    assert recs["b"]["first_token_s"] > recs["b"]["arrival_s"]


def test_the_run_window_leaves_unfinished_requests_null_and_ends():
    trace = [TraceRequest("r", 0.0, 1000, 3), TraceRequest("late", 10.0, 10, 1)]
    sched, clock = fcfs(MS_PER_TOKEN)
    r, late = simulate(sched, MS_PER_TOKEN, clock, trace, "fcfs", horizon_s=0.5)
    assert r["first_token_s"] is None and r["finish_s"] is None and r["finish_reason"] is None
    assert late["first_token_s"] is None and late["output_tokens"] == 0
    assert 0.5 <= clock.now < 0.7
    s = summarize([r, late])
    assert math.isinf(s["short_ttft_p50"]) and s["short"] == 2


def test_a_request_that_can_never_fit_is_aborted_instead_of_livelocking():
    sched, clock = fcfs(MS_PER_TOKEN, blocks=10)
    trace = [TraceRequest("huge", 0.0, 1000, 2), TraceRequest("ok", 0.0, 50, 2)]
    huge, ok = simulate(sched, MS_PER_TOKEN, clock, trace, "fcfs")
    assert huge["finish_reason"] == "abort" and huge["first_token_s"] is None
    assert ok["finish_reason"] == "length"


def test_percentile_counts_unreached_values_as_infinite():
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, math.inf], 50) == 2.0
    assert math.isinf(percentile([1.0, 2.0, math.inf], 90))
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("spp", [1, 2])
def test_gpu_model_fast_paths_match_predict(spp):
    model = GpuTimeModel("llama3-8b", "a100", tp=8, spp=spp)
    rng = random.Random(spp)
    for _ in range(50):
        decodes = tuple(ScheduledChunk(f"d{i}", rng.randrange(1, 200_000), 1, True)
                        for i in range(rng.randrange(0, 40)))
        prefills = tuple(ScheduledChunk(f"p{i}", rng.randrange(0, 500_000),
                                        rng.randrange(1, 8192), rng.random() < 0.3)
                         for i in range(rng.randrange(0, 3)))
        plan = BatchPlan(decodes, prefills)
        start, n, samples = rng.randrange(0, 900_000), rng.randrange(1, 4096), rng.random() < .5
        extended = BatchPlan(decodes, prefills + (ScheduledChunk("x", start, n, samples),))
        assert model.chunk_timer(plan)("x", start, n, samples) == model.predict(extended)
        assert model.stage_chunk_timer(plan)("x", start, n, samples) == \
            model.stage_time(extended)
        assert StageTimes(model).predict(extended) == model.stage_time(extended)
        if spp == 1:
            assert model.stage_time(extended) == model.predict(extended)
        else:  # a stage holds half the layers: about half the latency
            assert 0.45 < model.stage_time(extended) / model.predict(extended) < 0.6


def test_pipeline_drain_of_the_gpu_model():
    """The simulator's deadline policies owe a pipeline's last pass: for TP8 x SPP2 about
    half of a 50 ms iteration (the other stage), nothing without a pipeline."""
    assert pipeline_drain(GpuTimeModel("llama3-8b", "a100", tp=8, spp=1), 0.05) == 0.0
    drain = pipeline_drain(GpuTimeModel("llama3-8b", "a100", tp=8, spp=2), 0.05)
    assert 0.018 < drain < 0.027
    cfg = SimConfig(tp=8, spp=2)
    assert _prefill_cache(cfg, 65_536).drain_s == drain
    assert _prefill_cache(SimConfig(tp=8, spp=2, pipeline_drain=False), 65_536).drain_s == 0.0


def test_kv_capacity_of_tp8_spp2_on_a100():
    # 8 KiB of KV a token per GPU (16 layers, 1 KV head of 128, K and V in bf16); 90% of
    # 80 GiB less a sixteenth of the ~16 GB of weights.
    tokens = GpuTimeModel("llama3-8b", "a100", tp=8, spp=2).kv_cache_tokens()
    assert tokens == pytest.approx((0.9 * 80 * 2**30 - 16.06e9 / 16) / 8192, rel=0.01)
    assert GpuTimeModel("llama3-8b", "a100", tp=8, spp=1).kv_cache_tokens() < tokens


def test_requests_with_tokens_in_flight_count_against_max_num_seqs():
    sched, clock = SarathiScheduler(PageAllocator(4097, 16), max_num_seqs=2,
                                    max_num_batched_tokens=100, max_prefill_seqs=4), VirtualClock()
    seen = []

    class Watching(TwoStagePipeline):
        def predict(self, plan):
            seen.append(len(sched.running))
            return super().predict(plan)

    trace = [TraceRequest(f"r{i}", 0.0, 40, 6) for i in range(5)]
    records = simulate(sched, Watching(), clock, trace, "sarathi")
    assert all(r["finish_reason"] == "length" for r in records)
    assert max(seen) == 2

"""The offline evaluation harness: metric computations on hand-made records, workload
construction (scales, long share, arrivals), record files, and seconds-long live runs in
process and over gRPC, plus the convoy benchmark script end to end at smoke scale."""
from __future__ import annotations

import asyncio
import csv
import importlib.util
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from harness.workload import WorkloadSpec, build_workload
from jserve.bench.metrics import Slo, format_summary, ratio, summarize
from jserve.bench.replay import run_http, run_local, run_remote
from jserve.data import trace_path
from jserve.serving.app import BackgroundServer, ServerConfig
from jserve.sim.trace import (
    MEDHA_SWE_PROMPT_RANGE,
    TraceRequest,
    read_records,
    read_trace,
    write_records,
    write_trace,
)
from llm_helpers import SMALL, small_llm

ROOT = Path(__file__).resolve().parent.parent


def rec(rid, prompt, arrival, times, finished=True):
    """A record whose tokens came at ``times`` (run seconds)."""
    return {"request_id": rid, "prompt_tokens": prompt, "output_tokens": len(times),
            "arrival_s": arrival, "first_token_s": times[0] if times else None,
            "finish_s": times[-1] if finished and times else None,
            "finish_reason": "length" if finished else None, "policy": "p",
            "token_times_s": list(times)}


# -- metrics on hand-made records -------------------------------------------------------------
def test_metrics_of_hand_made_records():
    recs = [rec("a", 10, 0.0, [1.0, 1.5, 2.0, 3.0]),   # TTFT 1, gaps .5 .5 1, TPOT 2/3
            rec("b", 20, 1.0, [1.5, 2.5]),              # TTFT .5, gap 1, TPOT 1
            rec("c", 30, 2.0, [4.0], finished=False),   # TTFT 2, never finished
            rec("L", 5000, 0.0, [8.0, 8.1, 8.2])]       # long: TTFT 8, TPOT .1
    s = summarize(recs, long_prompt_tokens=1000, slo=Slo(ttft_s=1.0, tpot_s=0.8),
                  window_s=10.0)
    assert (s["short"], s["long"], s["short_completed"], s["long_completed"]) == (3, 1, 2, 1)
    assert s["short_ttft_p50"] == pytest.approx(1.0)
    assert s["short_ttft_p90"] == pytest.approx(1.0 + 0.8 * 1.0)  # between 1 and 2
    assert s["short_tpot_p50"] == pytest.approx((2 / 3 + 1) / 2)
    assert sorted(s[f"short_tbt_p{q}"] for q in (50, 90, 99)) == pytest.approx(
        [0.5 + 0.5 * 0.5, 1.0, 1.0])  # gaps .5 .5 1 1: P50 .75
    assert s["short_e2e_p50"] == pytest.approx(3.0) and math.isinf(s["short_e2e_p90"])
    assert s["long_ttft_p50"] == pytest.approx(8.0) and s["long_tpot_p90"] == pytest.approx(0.1)
    # Normalized latency: e2e / output tokens of finished requests: a 3/4, b 1.5/2.
    assert s["short_normalized_latency"] == pytest.approx((0.75 + 0.75) / 2)
    # TTFT SLO 1 s: c (2 s) and L (8 s) miss; b's TPOT 1 > 0.8, so only a meets both.
    assert s["short_deadline_miss_rate"] == pytest.approx(1 / 3)
    assert s["long_deadline_miss_rate"] == 1.0
    assert s["goodput_rps"] == pytest.approx(1 / 10)
    assert "never" in format_summary(s)


def test_ttft_slo_grows_with_the_prompt_and_the_default_window_spans_the_run():
    slo = Slo(ttft_s=0.5, ttft_per_token_s=1e-3, tpot_s=0.2)
    assert slo.ttft_deadline(100) == 0.5 and slo.ttft_deadline(5000) == 5.0
    long = rec("L", 5000, 1.0, [5.0, 5.1])  # TTFT 4 s: within 5 s
    s = summarize([long], long_prompt_tokens=1000, slo=slo)
    assert s["long_deadline_miss_rate"] == 0.0
    assert s["window_s"] == pytest.approx(4.1) and s["goodput_rps"] == pytest.approx(1 / 4.1)
    with pytest.raises(ValueError):
        Slo(tpot_s=0)


def test_ratio_treats_never_as_infinitely_worse():
    assert ratio(10.0, 0.5) == 20.0
    assert math.isinf(ratio(math.inf, 0.5))
    assert math.isnan(ratio(math.inf, math.inf))
    assert ratio(1.0, math.inf) == 0.0


def test_records_keep_token_times_and_reject_unknown_fields(tmp_path):
    recs = [rec("a", 10, 0.0, [1.0, 1.5]), rec("b", 10, 0.5, [], finished=False)]
    write_records(tmp_path / "r.jsonl", recs)
    assert read_records(tmp_path / "r.jsonl") == recs
    (tmp_path / "bad.jsonl").write_text(json.dumps({**recs[0], "colour": 1}) + "\n")
    with pytest.raises(ValueError, match="colour"):
        read_records(tmp_path / "bad.jsonl")


# -- workloads --------------------------------------------------------------------------------
def test_workload_scales_each_group_and_keeps_them_apart(tmp_path):
    spec = WorkloadSpec(num_requests=200, long_fraction=0.1, qps=2.0, short_scale=1 / 4,
                        long_scale=1 / 32, output_scale=1 / 4, min_tokens=64, seed=3)
    trace = build_workload(spec)
    split = spec.long_prompt_tokens
    assert split == MEDHA_SWE_PROMPT_RANGE[0] // 32
    long = [t for t in trace if t.prompt_tokens >= split]
    short = [t for t in trace if t.prompt_tokens < split]
    assert len(long) == 20
    assert all(split <= t.prompt_tokens <= MEDHA_SWE_PROMPT_RANGE[1] // 32 for t in long)
    assert all(64 <= t.prompt_tokens <= 8192 // 4 for t in short)
    assert all(t.output_tokens >= 1 for t in trace)
    gaps = np.diff([t.arrival_s for t in trace])
    assert (gaps >= 0).all() and 0.3 < gaps.mean() < 0.7  # Poisson at 2/s
    # Twice the rate: the same draws, half the times.
    fast = build_workload(WorkloadSpec(**{**spec.__dict__, "qps": 4.0}))
    assert [t.arrival_s / 2 for t in trace] == pytest.approx([t.arrival_s for t in fast])
    assert [t.prompt_tokens for t in fast] == [t.prompt_tokens for t in trace]
    write_trace(tmp_path / "w.csv", trace)
    back = read_trace(tmp_path / "w.csv")
    assert [(t.prompt_tokens, t.output_tokens) for t in back] == [
        (t.prompt_tokens, t.output_tokens) for t in trace]
    assert spec.describe().startswith("200 requests (10% long), Poisson 2.0 req/s, seed 3")


def test_replayed_arrivals_are_the_trace_times_stretched():
    spec = WorkloadSpec(num_requests=30, qps=None, arrival_trace="azure-conv", time_scale=5.0)
    with open(trace_path("azure-conv"), newline="") as f:
        times = [float(r["arrived_at"]) for _, r in zip(range(30), csv.DictReader(f))]
    assert [t.arrival_s for t in build_workload(spec)] == pytest.approx(
        [(x - times[0]) * 5 for x in times])


@pytest.mark.parametrize("bad", [dict(qps=None), dict(long_fraction=1.5),
                                 dict(short_scale=0), dict(num_requests=0)])
def test_bad_workload_settings_are_refused(bad):
    with pytest.raises(ValueError):
        WorkloadSpec(**{"qps": 1.0, **bad})


def test_a_short_scale_that_reaches_the_long_split_is_refused():
    with pytest.raises(ValueError, match="short_scale"):
        build_workload(WorkloadSpec(num_requests=50, short_scale=1.0, long_scale=1 / 64))


# -- live runs --------------------------------------------------------------------------------
TINY = [TraceRequest("0", 0.0, 40, 6), TraceRequest("1", 0.05, 300, 4),
        TraceRequest("2", 0.1, 12, 5), TraceRequest("3", 0.3, 20, 3)]


def check_records(records, trace):
    assert [r["request_id"] for r in records] == [t.request_id for t in trace]
    for r, t in zip(records, trace):
        times = r["token_times_s"]
        assert r["finish_reason"] == "length" and r["output_tokens"] == t.output_tokens
        assert len(times) == t.output_tokens and times == sorted(times)
        assert r["arrival_s"] == t.arrival_s <= r["first_token_s"] == times[0]
        assert r["finish_s"] == times[-1]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fcfs", "lars"])
def test_local_run_replays_arrivals_and_records_every_token(policy):
    eng = small_llm(scheduler=policy).engine
    records = run_local(eng, TINY, progress=False)
    check_records(records, TINY)
    assert {r["policy"] for r in records} == {policy}
    assert eng.allocator.num_allocated == 0 and not eng.requests


def test_the_window_cuts_the_run_and_frees_everything():
    eng = small_llm().engine
    trace = [TraceRequest("a", 0.0, 200, 40), TraceRequest("late", 30.0, 10, 2)]
    a, late = run_local(eng, trace, window_s=0.2, progress=False)
    assert a["finish_s"] is None and a["finish_reason"] is None
    assert a["output_tokens"] == len(a["token_times_s"]) < 40
    assert late["first_token_s"] is None and late["output_tokens"] == 0
    assert eng.allocator.num_allocated == 0 and not eng.requests


def test_a_trace_the_engine_cannot_hold_fails_before_the_run():
    eng = small_llm().engine
    with pytest.raises(ValueError, match="trace request big"):
        run_local(eng, [TraceRequest("ok", 0.0, 10, 2), TraceRequest("big", 0.0, 600, 2)],
                  progress=False)
    assert not eng.requests


def test_remote_run_streams_the_same_shape_of_records():
    server = BackgroundServer(small_llm(scheduler="lars").engine,
                              ServerConfig(host="127.0.0.1", port=0, metrics_port=0))
    try:
        records = asyncio.run(run_remote(server.target, TINY, progress=False))
    finally:
        server.stop(grace=0)
    check_records(records, TINY)
    assert {r["policy"] for r in records} == {"lars"}


def test_http_target_records_what_the_grpc_target_records():
    """The OpenAI-HTTP target against jserve's own HTTP API (same process and engine as the
    gRPC one): same records, and the window aborts what it cuts."""
    server = BackgroundServer(small_llm(scheduler="lars").engine,
                              ServerConfig(port=0, metrics_port=None, http_port=0))
    try:
        records = asyncio.run(run_http(server.http_url, TINY, progress=False))
        check_records(records, TINY)
        assert {r["policy"] for r in records} == {"lars"}
        # A closed loop of one: each request is sent once the one before has finished, and
        # its latency counts from then.
        one = asyncio.run(run_http(server.http_url, TINY, progress=False, concurrency=1))
        assert [r["output_tokens"] for r in one] == [t.output_tokens for t in TINY]
        for before, r, t in zip(one, one[1:], TINY[1:]):
            assert r["arrival_s"] >= max(before["finish_s"], t.arrival_s)
            assert r["arrival_s"] <= r["first_token_s"]
        # 300 tokens and a 200-token prefill are ~310 steps: far more than 0.05 s of them
        # on any machine (0.3 s was not: a fast CPU decoded them all in 0.24 s).
        cut = asyncio.run(run_http(server.http_url, [TraceRequest("a", 0.0, 200, 300)],
                                   window_s=0.05, progress=False))[0]
        assert cut["finish_s"] is None and 0 <= cut["output_tokens"] < 300
        for _ in range(100):
            st = server.stats()
            if st["in_flight"] == 0 and st["pages_used"] == 0:
                break
            time.sleep(0.02)
        assert st["in_flight"] == 0 and st["pages_used"] == 0, st
    finally:
        server.stop(grace=0)


@pytest.mark.slow
def test_convoy_benchmark_script_end_to_end(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("convoy", ROOT / "scripts" /
                                                  "convoy_benchmark.py")
    convoy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convoy)
    assert convoy.SMOKE_ENGINE == SMALL  # the suite's compiled shapes
    convoy.main(["--smoke", "--out-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["policy"] for r in summary["runs"]] == ["fcfs", "sarathi", "edf", "lars"]
    for policy in ("fcfs", "sarathi", "edf", "lars"):
        records = read_records(tmp_path / f"records-{policy}.jsonl")
        assert len(records) == convoy.SMOKE.num_requests
        assert all(r["finish_reason"] == "length" for r in records)
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "tpot.png").stat().st_size > 0
    assert "| lars | 8 |" in out and ("PASS lars completed" in out)


def test_sweep_results_make_every_plot_and_a_ratio_table(tmp_path):
    from harness.evaluate import PolicyResult, ratio_table, write_plots

    results = []
    for qps in (1.0, 2.0):
        for policy, wait in (("fcfs", 10.0 * qps), ("lars", 0.2)):
            recs = [rec("s", 10, 0.0, [wait, wait + 0.1]), rec("L", 5000, 0.0, [20.0, 20.5])]
            results.append(PolicyResult(policy, qps, recs, summarize(
                recs, long_prompt_tokens=1000), 1.0))
    paths = write_plots(results, tmp_path, title="t", long_prompt_tokens=1000)
    assert [p.name for p in paths] == ["ttft_cdf.png", "tpot.png", "qps_sweep.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    table = ratio_table(results, "fcfs", keys=("short_ttft_p50",))
    assert "| lars | 2 | 0.200 (100.0x) |" in table and "| fcfs | 1 | 10.000 |" in table

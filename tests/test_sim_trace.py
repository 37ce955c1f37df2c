"""Trace files in (CSV and JSONL, Poisson arrivals), record files out, synthetic long requests."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jserve.sim.trace import (
    MEDHA_SWE_PROMPT_RANGE,
    RECORD_FIELDS,
    TraceRequest,
    lognormal_lengths,
    mix_long_requests,
    poisson_arrivals,
    read_records,
    read_trace,
    write_records,
    write_trace,
)

ROWS = [(0.0, 374, 44), (4.3, 396, 109), (19.5, 1200, 1)]


def test_csv_and_jsonl_traces_read_the_same(tmp_path):
    csv_path, jsonl_path = tmp_path / "t.csv", tmp_path / "t.jsonl"
    csv_path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                        + "".join(f"{a},{p},{d}\n" for a, p, d in ROWS))
    jsonl_path.write_text("".join(json.dumps({"arrived_at": a, "num_prefill_tokens": p,
                                              "num_decode_tokens": d}) + "\n"
                                  for a, p, d in ROWS))
    expected = [TraceRequest(str(i), a, p, d) for i, (a, p, d) in enumerate(ROWS)]
    assert read_trace(csv_path) == expected
    assert read_trace(jsonl_path) == expected
    assert read_trace(csv_path, max_requests=2) == expected[:2]


def test_write_trace_round_trips_both_formats(tmp_path):
    reqs = [TraceRequest(str(i), a, p, d) for i, (a, p, d) in enumerate(ROWS)]
    for name in ("w.csv", "w.jsonl"):
        write_trace(tmp_path / name, reqs)
        assert read_trace(tmp_path / name) == reqs


def test_missing_arrivals_need_qps_and_bad_rows_are_rejected(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n20,6\n")
    with pytest.raises(ValueError, match="arrived_at"):
        read_trace(path)
    assert [t.prompt_tokens for t in read_trace(path, qps=2.0)] == [10, 20]
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,0,5\n")
    with pytest.raises(ValueError, match=">= 1"):
        read_trace(bad)
    (tmp_path / "trace.txt").write_text(path.read_text())
    with pytest.raises(ValueError, match="csv or .jsonl"):
        read_trace(tmp_path / "trace.txt")


def test_poisson_arrivals_are_reproducible_and_at_the_rate(tmp_path):
    a, b = poisson_arrivals(20_000, 2.0, seed=7), poisson_arrivals(20_000, 2.0, seed=7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, poisson_arrivals(20_000, 2.0, seed=8))
    assert np.all(np.diff(a) > 0)
    assert 20_000 / a[-1] == pytest.approx(2.0, rel=0.03)
    gaps = np.diff(a)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential gaps
    # Same seed at another rate: the same draws, time scaled (a load sweep varies only load).
    np.testing.assert_allclose(poisson_arrivals(100, 0.5, seed=7), a[:100] * 4)
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"num_prefill_tokens": 5, "num_decode_tokens": 2}\n' * 3)
    assert [t.arrival_s for t in read_trace(path, qps=2.0, seed=7)] == pytest.approx(a[:3])


def test_records_round_trip_and_reject_other_fields(tmp_path):
    records = [dict(request_id="0", prompt_tokens=10, output_tokens=3, arrival_s=0.5,
                    first_token_s=0.7, finish_s=1.0, finish_reason="length", policy="lars"),
               dict(request_id="1", prompt_tokens=900_000, output_tokens=0, arrival_s=1.5,
                    first_token_s=None, finish_s=None, finish_reason=None, policy="lars")]
    write_records(tmp_path / "r.jsonl", records)
    back = read_records(tmp_path / "r.jsonl")
    assert back == records
    assert list(back[0]) == list(RECORD_FIELDS)
    (tmp_path / "bad.jsonl").write_text(json.dumps({**records[0], "extra": 1}) + "\n")
    with pytest.raises(ValueError, match="fields"):
        read_records(tmp_path / "bad.jsonl")


def test_lognormal_lengths_hit_the_two_quantiles_and_the_clip():
    rng = np.random.default_rng(0)
    x = lognormal_lengths(rng, 200_000, 393_000, 839_000)
    assert np.percentile(x, 50) == pytest.approx(393_000, rel=0.02)
    assert np.percentile(x, 90) == pytest.approx(839_000, rel=0.02)
    clipped = lognormal_lengths(rng, 10_000, 393_000, 839_000, *MEDHA_SWE_PROMPT_RANGE)
    assert clipped.min() == MEDHA_SWE_PROMPT_RANGE[0] and clipped.max() == MEDHA_SWE_PROMPT_RANGE[1]


def test_mix_long_requests_replaces_the_given_fraction():
    short = [(100, 10), (200, 20)]
    pairs = mix_long_requests(short, 1000, 0.05, seed=3)
    assert pairs == mix_long_requests(short, 1000, 0.05, seed=3)
    long = [p for p, _ in pairs if p >= MEDHA_SWE_PROMPT_RANGE[0]]
    assert len(long) == 50 and all(p <= MEDHA_SWE_PROMPT_RANGE[1] for p in long)
    assert {pair for pair in pairs if pair[0] < 1000} == set(short)
    assert math.isclose(np.median([o for p, o in pairs if p >= 131072]), 518, rel_tol=0.3)

"""Goodput by bisection over QPS (``jserve.sim.goodput``) on a toy configuration whose answer
is known in closed form: one LoongServe instance serving identical one-token requests FCFS."""
from __future__ import annotations

import pytest

from jserve.sim.goodput import GoodputSlo, at_rate, attainment, bisect_goodput, meets
from jserve.sim.loongserve import simulate_loongserve
from jserve.sim.loongserve_manager import GlobalManager
from jserve.sim.trace import TraceRequest
from tests.test_sim_loongserve_rules import ToyCosts


def test_bisection_finds_the_closed_form_goodput_of_a_single_fcfs_server():
    # 20 requests 1 / qps apart, each a 1000-token prompt: 0.1 s of prefill (ToyCosts), one
    # output token. Served FCFS one at a time (tipping point 0), request k's TTFT is
    # p + k (p - 1 / qps) once arrivals outpace the server. 90% of 20 within D = 0.5 s means
    # k = 17 still meets it: 17 (p - 1 / qps) <= D - p, so goodput = 1 / (p - (D - p) / 17).
    p, d, n = 0.1, 0.5, 20
    expected = 1 / (p - (d - p) / 17)
    base = [TraceRequest(f"r{k}", float(k), 1000, 1) for k in range(n)]
    slo = GoodputSlo(short_ttft_s=d)
    costs = ToyCosts()
    runs = []

    def ok(qps: float) -> bool:
        gm = GlobalManager(1, 10_000, costs, tipping_s=0.0)
        recs = simulate_loongserve(at_rate(base, qps), costs, 1, manager=gm, check=True)
        runs.append(qps)
        return meets(recs, [d] * n, slo)

    found = bisect_goodput(ok, 1.0, 2.0, rel_tol=0.01)
    assert expected == pytest.approx(13.077, abs=1e-3)
    assert expected / 1.01 <= found <= expected
    assert len(runs) < 15


def test_attainment_counts_each_class_and_long_deadlines_scale_with_isolated_ttft():
    slo = GoodputSlo(short_ttft_s=1.0, long_ttft_factor=2.0, tpot_s=0.1,
                     long_prompt_tokens=1000)
    trace = [TraceRequest("s", 0.0, 10, 3), TraceRequest("l", 0.0, 5000, 3)]
    deadlines = slo.deadlines(trace, [0.05, 4.0])
    assert deadlines == [1.0, 8.0]

    def rec(rid, prompt, first, times):
        return {"request_id": rid, "prompt_tokens": prompt, "arrival_s": 0.0,
                "first_token_s": first, "finish_s": times[-1], "output_tokens": len(times)}
    fast_long = [rec("s", 10, 0.5, [0.5, 0.55, 0.6]), rec("l", 5000, 7.9, [7.9, 8.0, 8.1])]
    assert attainment(fast_long, deadlines, slo) == {"short": 1.0, "long": 1.0, "tpot": 1.0}
    starved = [rec("s", 10, 0.5, [0.5, 0.55, 0.6]), rec("l", 5000, 8.1, [8.1, 8.5, 8.9])]
    assert attainment(starved, deadlines, slo) == {"short": 1.0, "long": 0.0, "tpot": 0.5}
    assert meets(fast_long, deadlines, slo) and not meets(starved, deadlines, slo)


def test_bisection_rejects_a_bad_bracket_and_reports_zero_when_nothing_meets():
    with pytest.raises(ValueError):
        bisect_goodput(lambda q: True, 2.0, 1.0)
    assert bisect_goodput(lambda q: False, 1.0, 2.0) == 0.0
    assert bisect_goodput(lambda q: q <= 0.3, 1.0, 2.0, rel_tol=0.01) == pytest.approx(
        0.3, rel=0.011)

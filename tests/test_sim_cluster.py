"""The simulator's cluster mode: one replica is the single-replica simulator exactly; with two,
each router's decisions are the routing policies' on the replicas' reports."""
from __future__ import annotations

import dataclasses

import pytest

from jserve.routing import choose
from jserve.routing.policies import RouteRequest
from jserve.routing.replica import prefill_table
from jserve.sim.cluster import _Replica, _request, replica_views, run_cluster
from jserve.sim.policies import SimConfig, _cached_prefill_cache, build, run
from jserve.sim.simulator import VirtualClock
from jserve.sim.trace import TraceRequest

CFG = SimConfig(model="llama3-8b", hardware="a100", tp=1)


def _trace(n=24, gap=0.05):
    lengths = [(300, 12), (5000, 20), (900, 8), (60_000, 6)]
    return [TraceRequest(str(i), i * gap, *lengths[i % len(lengths)]) for i in range(n)]


@pytest.mark.parametrize("policy", ["sarathi", "lars-ss"])
def test_one_replica_is_the_single_replica_simulator(policy):
    trace = _trace()
    alone = run(trace, policy, CFG)
    cluster = run_cluster(trace, policy, "deadline", 1, CFG)
    assert [r.pop("replica") for r in cluster] == [0] * len(trace)
    assert cluster == alone


def _long_then_shorts():
    # A 60K-token document at t=0, then two short chats while it is being prefilled.
    return [TraceRequest("doc", 0.0, 60_000, 4), TraceRequest("s1", 0.5, 200, 4),
            TraceRequest("s2", 1.0, 200, 4)]


def test_the_deadline_router_keeps_short_requests_off_a_replica_prefilling_a_document():
    trace = _long_then_shorts()
    ttft = {}
    for router in ("round_robin", "deadline"):
        recs = {r["request_id"]: r for r in run_cluster(trace, "sarathi", router, 2, CFG)}
        ttft[router] = {k: r["first_token_s"] - r["arrival_s"] for k, r in recs.items()}
        where = {k: r["replica"] for k, r in recs.items()}
        if router == "round_robin":  # its turn sends s2 behind the document
            assert where == {"doc": 0, "s1": 1, "s2": 0}
        else:
            assert where == {"doc": 0, "s1": 1, "s2": 1}
    assert ttft["deadline"]["s2"] < 0.2 < ttft["round_robin"]["s2"]
    assert ttft["deadline"]["doc"] == pytest.approx(ttft["round_robin"]["doc"], rel=0.05)


def test_prefix_affinity_in_the_simulator_sends_a_document_to_the_replica_that_holds_it():
    cfg = dataclasses.replace(CFG, prefix_caching=True)
    trace = [TraceRequest(str(i), i * 2.0, 8000, 4, prefix_id="d", prefix_tokens=7000)
             for i in range(4)]
    for router in ("prefix", "deadline"):
        recs = run_cluster(trace, "lars", router, 2, cfg)
        assert len({r["replica"] for r in recs}) == 1, router
        assert all(r["finish_reason"] == "length" for r in recs)
    spread = run_cluster(trace, "lars", "round_robin", 2, cfg)
    assert [r["replica"] for r in spread] == [0, 1, 0, 1]


def test_the_cluster_routes_by_the_reports_its_replicas_give():
    """The simulator's choice for a short request while replica 0 prefills a document is the
    routing policy's on the reports read from the two schedulers at that moment."""
    clock = VirtualClock()
    reps = []
    for i in range(2):
        sched, predictor = build("sarathi", CFG, clock, 65_536)
        cache = _cached_prefill_cache(CFG.model, CFG.hardware, 1, 1, 1, 1e9, CFG.sarathi_chunk,
                                      65_536)
        reps.append(_Replica(i, sched, predictor, prefill_table(cache, 65_536)))
    doc = _request(TraceRequest("doc", 0.0, 60_000, 4))
    reps[0].scheduler.add(doc)
    for _ in range(3):  # three chunks of the document's prefill
        plan = reps[0].scheduler.schedule()
        reps[0].scheduler.update(plan, [0] * sum(c.samples for c in plan.prefills))
    clock.now = 0.5
    short = _request(TraceRequest("s", 0.5, 200, 4))
    views = replica_views(reps, short, clock.now)
    assert views[0].load.prefills[0].tokens == 60_000 - 3 * CFG.sarathi_chunk
    assert views[1].load.prefills == ()
    assert choose("deadline", RouteRequest(200, None, 0), views) == 1
    assert choose("round_robin", RouteRequest(200, None, 0), views) == 0


def test_bad_cluster_arguments_are_refused():
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        run_cluster(_trace(2), "lars", "deadline", 0, CFG)
    with pytest.raises(ValueError, match="router must be one of"):
        run_cluster(_trace(2), "lars", "fastest", 2, CFG)
    with pytest.raises(ValueError, match="loongserve"):
        run_cluster(_trace(2), "loongserve", "deadline", 2, CFG)


def test_jserve_simulate_runs_replicas_behind_a_router(tmp_path, capsys):
    from jserve.cli import main
    from jserve.sim.trace import read_records, write_trace
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(8))
    out = tmp_path / "r.jsonl"
    assert main(["simulate", "--trace", str(trace), "--policy", "sarathi", "--tp", "1",
                 "--replicas", "2", "--router", "round_robin", "--out", str(out)]) == 0
    recs = read_records(out)
    assert [r["replica"] for r in recs] == [0, 1] * 4
    assert all(r["finish_reason"] == "length" for r in recs)
    assert "2 replicas of llama3-8b a100 tp=1 spp=1 kvp=1 behind round_robin" in \
        capsys.readouterr().out

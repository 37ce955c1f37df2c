"""Prefill/decode disaggregation: ``place`` decides from constructed reports (pure functions,
no device), and the simulator's disaggregated cluster (``jserve.sim.disagg``) moves a
prompt's KV into the decode replica's prefix cache, so only its last page is computed there."""
from __future__ import annotations

import dataclasses
import math

import pytest

from jserve.routing import (
    MODES,
    PrefillTable,
    QueuedPrefill,
    ReplicaLoad,
    ReplicaView,
    RouteRequest,
    TransferCost,
    choose,
    place,
)
from jserve.routing.disagg import DEFAULT_BYTES_PER_S
from jserve.routing.load import DEADLINE_ORDER, FIFO
from jserve.sim.cluster import run_cluster
from jserve.sim.disagg import decode_config, run_disagg, simulate_disagg, transfer_cost
from jserve.sim.policies import SimConfig
from jserve.sim.trace import TraceRequest

# 1 ms a prompt token: T(n) = n / 1000 s. Transfer: 10 us a token (a 200K prompt: 2 s).
TABLE = PrefillTable((0, 1_000_000), (0.0, 1000.0))
LINK = TransferCost(bytes_per_token=10_000, bytes_per_s=1e9)
EXTRA = ("prefill_replica", "transfer_s", "kv_import", "prefill_done_s", "decode_prompt_tokens")


def _load(name="r", *, prefills=(), waiting=0, running=0, kv=0.0, order=FIFO, healthy=True,
          t_target=0.0, decode_s=0.0, quick_s=0.0, max_num_seqs=0):
    return ReplicaLoad(name, healthy, waiting, running, kv, order,
                       tuple(QueuedPrefill(*p) for p in prefills), TABLE, 32768,
                       t_target=t_target, decode_s=decode_s, quick_s=quick_s,
                       max_num_seqs=max_num_seqs)


def _views(*loads):
    return [ReplicaView(x) for x in loads]


def _place(mode, tokens, decode, prefill, slo=None, link=LINK):
    return place(mode, RouteRequest(tokens, slo), decode, prefill, link)


def test_a_short_chat_stays_colocated():
    got = _place("auto", 500, _views(_load("d0"), _load("d1")), _views(_load("p0")))
    assert got.prefill is None and not got.disaggregated
    assert got.predicted_ttft_s == pytest.approx(0.5)
    assert got.reason == "short prompt"


def test_a_long_document_whose_deadline_allows_the_transfer_goes_to_a_prefill_engine():
    # 200K tokens: 200 s alone, due 1.5 x 200 = 300 s; disaggregated 200 + 2 s of transfer
    # + the last page on the decode engine. Colocated would be sooner (200 s), and meets too.
    decode, prefill = _views(_load("d0"), _load("d1", running=2)), _views(_load("p0"))
    got = _place("auto", 200_000, decode, prefill)
    assert (got.prefill, got.decode) == (0, 0)
    # the prompt ends on a page boundary: its whole last page (16 tokens) is recomputed
    assert got.predicted_ttft_s == pytest.approx(200.0 + 2.0 + 0.016)
    assert got.reason == "long prompt off the decode engines"
    # A link so slow that the transfer (200 s) would make it late: colocated.
    slow = TransferCost(bytes_per_token=1e6, bytes_per_s=1e9)
    late = _place("auto", 200_000, decode, prefill, link=slow)
    assert late.prefill is None and late.reason == "prefill pool late, decode engine idle"


def test_when_colocating_misses_the_deadline_and_disaggregating_meets_it_disaggregate():
    # The decode engines' decodes take 90% of each iteration: a 1,000-token prefill there
    # runs at a tenth of its speed (10 s, due 1.5 s); on the idle prefill engine it takes 1 s,
    # then only its last page (8 tokens) runs on a decode engine, 8 ms at a tenth of speed.
    busy = dict(running=100, t_target=0.05, decode_s=0.045)
    decode = _views(_load("d0", **busy), _load("d1", **busy))
    got = _place("auto", 1000, decode, _views(_load("p0")))
    assert got.prefill == 0 and got.reason == "colocated late"
    assert got.predicted_ttft_s == pytest.approx(1.0 + 0.01 + 0.08, abs=1e-6)
    assert _place("never", 1000, decode, _views(_load("p0"))).predicted_ttft_s == \
        pytest.approx(10.0)


def test_a_deadline_ordered_decode_engine_runs_the_imported_tail_before_its_queue():
    # 5 s of prefills due before the newcomer: colocated it waits behind them; its tail is a
    # quick prefill (lars's due-first), which runs before them.
    queue = dict(prefills=[(1.0, 5.0, 5000)], order=DEADLINE_ORDER, t_target=0.05,
                 quick_s=0.2)
    got = _place("auto", 1000, _views(_load("d0", **queue)), _views(_load("p0")), slo=1.5)
    assert got.prefill == 0 and got.reason == "colocated late"
    assert got.predicted_ttft_s < 1.5


def test_when_the_prefill_pool_is_congested_colocate():
    # 150 s of prompts queued on the prefill engine: 150 + 200 + 2 s > 300 s due, while an
    # idle decode engine prefills the document in 200 s.
    prefill = _views(_load("p0", prefills=[(math.inf, 150.0, 150_000)], running=1))
    got = _place("auto", 200_000, _views(_load("d0")), prefill)
    assert got.prefill is None and got.reason == "prefill pool late, decode engine idle"
    assert got.predicted_ttft_s == pytest.approx(200.0)
    # a short chat behind the same queue: its 0.5 s there would be 150.5 s
    queued = _views(_load("p0", prefills=[(math.inf, 3.0, 3000)], running=1))
    busy = _views(_load("d0", running=3))
    got = _place("auto", 500, busy, queued)
    assert got.prefill is None and got.reason == "prefill pool late"
    assert _place("always", 500, busy, queued).prefill == 0


def test_a_long_document_stays_off_decode_engines_that_run_decodes_even_when_late():
    # The same congested pool, but the decode engine runs 20 decodes: colocating the
    # document would stretch all their iterations for 200 s; it waits in the pool.
    prefill = _views(_load("p0", prefills=[(math.inf, 150.0, 150_000)], running=1))
    decode = _views(_load("d0", running=20, t_target=0.05, decode_s=0.01))
    got = _place("auto", 200_000, decode, prefill)
    assert got.prefill == 0 and got.reason == "long prompt off the decode engines"
    assert got.predicted_ttft_s > 300


def test_a_short_chat_goes_to_the_prefill_pool_when_decode_slots_are_scarce():
    # Both placements on time; the decode engine has 70 of 128 slots taken (over half).
    loads = dict(t_target=0.05, decode_s=0.01, max_num_seqs=128)
    roomy = _views(_load("d0", running=50, **loads))
    tight = _views(_load("d0", running=60, waiting=10, **loads))
    assert _place("auto", 500, roomy, _views(_load("p0"))).prefill is None
    got = _place("auto", 500, tight, _views(_load("p0")))
    assert got.prefill == 0 and got.reason == "decode slots scarce"
    assert got.predicted_ttft_s < 0.75


def test_never_is_the_deadline_router_and_always_takes_the_soonest_prefill_engine():
    decode = _views(_load("d0", prefills=[(math.inf, 3.0, 3000)], running=1),
                    _load("d1", running=5), _load("d2", running=2))
    prefill = _views(_load("p0", prefills=[(math.inf, 4.0, 4000)]), _load("p1"))
    never = _place("never", 500, decode, prefill)
    assert never.prefill is None
    assert never.decode == choose("deadline", RouteRequest(500), decode) == 2
    always = _place("always", 500, decode, prefill)
    # the idle prefill engine; to decode, not d0 (fewest requests, but on a FIFO engine its
    # 3 s queue holds even the 4-token tail past the deadline): of the others, fewest requests
    assert always.prefill == 1 and always.decode == 2
    assert always.reason == "always disaggregate"
    assert always.predicted_ttft_s == pytest.approx(0.5 + LINK.seconds(500) + 0.004)


def test_without_a_healthy_prefill_engine_the_request_is_colocated():
    decode = _views(_load("d0"), _load("d1"))
    for mode in MODES:
        got = _place(mode, 200_000, decode, [])
        assert got.prefill is None
        down = _place(mode, 200_000, decode, _views(_load("p0", healthy=False)))
        assert down.prefill is None
    assert _place("always", 200_000, decode, _views(_load("p0"))).prefill == 0


def test_unhealthy_views_are_skipped_and_no_healthy_decode_engine_is_an_error():
    decode = _views(_load("d0", healthy=False), _load("d1", running=9))
    prefill = _views(_load("p0", healthy=False),
                     _load("p1", prefills=[(math.inf, 1.0, 1000)]))
    got = _place("always", 200_000, decode, prefill)
    assert (got.prefill, got.decode) == (1, 1)
    assert _place("never", 500, decode, prefill).decode == 1
    with pytest.raises(ValueError, match="no healthy decode engine"):
        _place("auto", 500, _views(_load("d0", healthy=False)), prefill)
    with pytest.raises(ValueError, match="mode must be one of"):
        _place("sometimes", 500, decode, prefill)


def test_a_decode_engine_with_every_slot_taken_is_passed_over_for_the_import():
    full = _load("d0", running=4, max_num_seqs=4)
    got = _place("always", 200_000, _views(full, _load("d1", running=3)), _views(_load("p0")))
    assert got.decode == 1


def test_transfer_cost_counts_tokens_latency_and_an_unknown_link():
    link = TransferCost(bytes_per_token=1000, bytes_per_s=2e9, latency_s=0.01, page_size=16)
    assert link.seconds(0) == 0.0
    assert link.seconds(2_000_000) == pytest.approx(1.01)
    unknown = TransferCost(bytes_per_token=1000, bytes_per_s=0)
    assert unknown.seconds(10**6) == pytest.approx(1e9 / DEFAULT_BYTES_PER_S)
    assert [link.tail_tokens(n) for n in (1, 16, 17, 300, 320)] == [1, 16, 1, 12, 16]


# -- the simulator ------------------------------------------------------------------------
CFG = SimConfig(model="llama3-8b", hardware="a100", tp=1)


def _trace(n=24, gap=0.05):
    lengths = [(300, 12), (5000, 20), (900, 8), (60_000, 6)]
    return [TraceRequest(str(i), i * gap, *lengths[i % len(lengths)]) for i in range(n)]


@pytest.mark.parametrize("mode", ["always", "auto"])
def test_a_disaggregated_run_finishes_every_request_and_computes_only_the_tail(mode):
    trace = _trace()
    recs, run = simulate_disagg(trace, "lars-ss", 1, 2, mode, CFG)
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == t.output_tokens
               for r, t in zip(recs, trace))
    for rep in (*run.prefill, *run.decode):
        rep.scheduler.allocator.check()
        assert rep.scheduler.allocator.num_allocated == 0
    moved = [r for r in recs if r["prefill_replica"] is not None]
    assert moved and all(r["kv_import"] == "imported" for r in moved)
    link = transfer_cost(CFG)
    for r in moved:
        # at most the last page, and exactly what the prefix lookup leaves
        assert r["decode_prompt_tokens"] == link.tail_tokens(r["prompt_tokens"]) <= 16
        assert r["transfer_s"] >= link.seconds(r["prompt_tokens"]) - 1e-12
        assert r["prefill_done_s"] + r["transfer_s"] < r["first_token_s"]
    for r in recs:
        if r["prefill_replica"] is None:
            assert r["decode_prompt_tokens"] == r["prompt_tokens"] and r["transfer_s"] == 0
    if mode == "always":
        assert len(moved) == len(recs)
    else:  # the short chats stay on the decode replicas
        assert {r["prompt_tokens"] for r in recs if r["prefill_replica"] is None} >= {300}


def test_the_decode_replicas_get_prefix_caching_for_the_import():
    assert not CFG.prefix_caching
    assert decode_config(CFG, "always", 1).prefix_caching
    assert decode_config(CFG, "never", 1) is CFG and decode_config(CFG, "auto", 0) is CFG
    _, run = simulate_disagg(_trace(4), "sarathi", 1, 1, "always", CFG)
    assert run.decode[0].scheduler.allocator.prefix_caching
    assert not run.prefill[0].scheduler.allocator.prefix_caching


def test_a_decode_replica_without_room_for_the_import_recomputes_and_still_finishes():
    # 70K tokens of KV: a 40K-token request decoding 600 tokens holds 40K when a 50K-token
    # document's KV arrives, so the document is recomputed there once it fits.
    cfg = dataclasses.replace(CFG, kv_cache_tokens=70_000)
    trace = [TraceRequest("a", 0.0, 40_000, 600), TraceRequest("b", 0.1, 50_000, 4)]
    recs, run = simulate_disagg(trace, "lars", 1, 1, "always", cfg)
    a, b = recs
    assert a["kv_import"] == "imported" and a["decode_prompt_tokens"] <= 16
    # its whole prompt (and more, were it preempted partway) runs on the decode replica
    assert b["kv_import"] == "recomputed" and b["decode_prompt_tokens"] >= 50_000
    assert b["prefill_done_s"] < a["finish_s"] <= b["first_token_s"]
    assert all(r["finish_reason"] == "length" for r in recs)
    run.decode[0].scheduler.allocator.check()


@pytest.mark.parametrize("policy", ["sarathi", "lars-ss"])
def test_never_is_the_deadline_routed_cluster_exactly(policy):
    trace = _trace()
    cluster = run_cluster(trace, policy, "deadline", 2, CFG)
    for prefill in (0, 2):
        recs = run_disagg(trace, policy, prefill, 2, "never", CFG)
        assert all(r["prefill_replica"] is None for r in recs)
        assert [{k: v for k, v in r.items() if k not in EXTRA} for r in recs] == cluster


def test_jserve_simulate_runs_prefill_and_decode_replicas(tmp_path, capsys):
    from jserve.cli import main
    from jserve.sim.trace import read_records, write_trace
    trace = tmp_path / "t.jsonl"
    write_trace(trace, _trace(8))
    out = tmp_path / "r.jsonl"
    assert main(["simulate", "--trace", str(trace), "--policy", "lars", "--tp", "1",
                 "--replicas", "2", "--prefill-replicas", "1", "--disaggregation", "always",
                 "--transfer-gb-per-s", "10", "--out", str(out)]) == 0
    recs = read_records(out)
    assert [r["prefill_replica"] for r in recs] == [0] * 8
    assert all(r["kv_import"] == "imported" and r["transfer_s"] > 0 for r in recs)
    assert "1 prefill + 2 decode replicas of llama3-8b" in capsys.readouterr().out

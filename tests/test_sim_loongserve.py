"""The LoongServe baseline (``GlobalManager`` + ``simulate_loongserve``) on constructed cases:
ESP spreads a prefill set over every idle instance, scale-down moves KV at the network
model's cost, and a long prefill starts at once beside a decoding short request."""
from __future__ import annotations

import functools

import pytest

from jserve.sim.esp import EspCosts
from jserve.sim.loongserve import simulate_loongserve, tipping_point_s
from jserve.sim.loongserve_manager import EspRequest, GlobalManager
from jserve.sim.trace import TraceRequest


@functools.lru_cache(maxsize=1)
def costs() -> EspCosts:
    return EspCosts("llama3-8b", "a100", instance_tp=2)


def manager(n=4, capacity=None, proactive=True) -> GlobalManager:
    c = costs()
    return GlobalManager(n, capacity or c.capacity_tokens(), c, tipping_s=tipping_point_s(c),
                         proactive=proactive)


def test_two_short_prefills_and_a_long_one_use_all_four_instances():
    gm = manager()
    pending = [EspRequest("s1", 600, 8, 0.0), EspRequest("s2", 400, 8, 0.0),
               EspRequest("long", 300_000, 8, 0.0)]
    batches = gm.step(0.0, pending, [])
    assert pending == []
    used = [i for b in batches for i in b.instances]
    assert sorted(used) == [0, 1, 2, 3]  # every instance, none twice
    by_request = {r.request_id: b for b in batches for r in b.requests}
    assert len(by_request["long"].instances) >= 2  # the long one is scaled up
    assert "s1" not in {r.request_id for r in by_request["long"].requests}
    # The long batch is timed on its degree: faster than on one instance, per EspCosts.
    long_batch = by_request["long"]
    assert long_batch.end_s - long_batch.start_s == pytest.approx(
        costs().prefill((300_000,), len(long_batch.instances)))
    assert long_batch.end_s - long_batch.start_s < costs().prefill((300_000,), 1) / 2
    gm.check()


@pytest.mark.parametrize("proactive", [False, True])
def test_scale_down_after_prefill_moves_kv_at_the_modelled_cost(proactive):
    c = costs()
    gm = manager(proactive=proactive)
    trace = [TraceRequest("long", 0.0, 200_000, 3)]
    recs = simulate_loongserve(trace, c, 4, manager=gm, check=True)
    (move,) = [m for m in gm.migrations if m.reason == "scale-down"]
    # Prefilled on 4 instances, kept on 1 (its KV fits one): 3/4 of the prompt travels.
    assert move.tokens == 200_000 * 3 // 4
    assert move.seconds == pytest.approx(c.migrate(move.tokens, move.src, move.dst))
    assert move.seconds > 0.01  # ~10 GB a GPU over NVLink: not free
    first, second = recs[0]["token_times_s"][:2]
    prefill = c.prefill((200_000,), 4)
    assert first == pytest.approx(prefill)
    exposed = move.seconds if not proactive else max(0.0, move.seconds - prefill)
    decode = c.decode((200_001,))
    assert second == pytest.approx(first + exposed + decode)
    assert sum(gm.used) == 0 and gm.placement == {}


def test_a_long_prefill_never_waits_for_a_short_one_to_finish_decoding():
    c = costs()
    # 100K KV slots per instance: the long request needs every instance's memory.
    gm = manager(capacity=100_000)
    trace = [TraceRequest("short", 0.0, 500, 3000), TraceRequest("long", 1.0, 350_000, 4)]
    recs = {r["request_id"]: r for r in simulate_loongserve(trace, c, 4, manager=gm,
                                                            check=True)}
    long, short = recs["long"], recs["short"]
    prefill = c.prefill((350_000,), 4)
    start = long["first_token_s"] - prefill
    assert start < 1.1  # it started within a decode round of its arrival
    assert short["finish_s"] > long["first_token_s"]  # the short was still decoding
    # The short's decodes stalled while every instance prefilled (no preemption of a prefill).
    gaps = [b - a for a, b in zip(short["token_times_s"], short["token_times_s"][1:])]
    assert max(gaps) == pytest.approx(prefill, rel=0.05)
    assert sum(gm.used) == 0


def test_a_short_arriving_during_an_all_instance_prefill_waits_for_it():
    c = costs()
    gm = manager()
    trace = [TraceRequest("long", 0.0, 400_000, 2), TraceRequest("short", 1.0, 500, 2)]
    recs = {r["request_id"]: r for r in simulate_loongserve(trace, c, 4, manager=gm)}
    # All four instances were idle, so the long prefill took them all (non-preemptive).
    assert recs["long"]["first_token_s"] == pytest.approx(c.prefill((400_000,), 4))
    assert recs["short"]["first_token_s"] > recs["long"]["first_token_s"]


def test_dispatch_is_fcfs_and_stops_at_the_first_request_that_does_not_fit():
    gm = manager(n=2, capacity=10_000)
    pending = [EspRequest("a", 15_000, 10, 0.0), EspRequest("b", 9_000, 10, 0.0),
               EspRequest("c", 100, 10, 0.0)]
    (batch,) = gm.step(0.0, pending, [])
    assert [r.request_id for r in batch.requests] == ["a"]  # b would fit nowhere after a
    assert [r.request_id for r in pending] == ["b", "c"]  # c does not overtake b
    assert gm.step(0.0, pending, []) == []  # every instance is prefilling

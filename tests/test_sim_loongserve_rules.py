"""LoongServe's rules (eqs. 1-5, scale-down, decode scale-up, multi-master decoding, instances
on their own clocks) on small constructed states with a toy cost model whose numbers can be
worked out by hand: every expected value below is computed in the test from the paper's
formula and the toy costs, not read back from the manager."""
from __future__ import annotations

import pytest

from jserve.sim.loongserve import iteration_s, simulate_loongserve
from jserve.sim.loongserve_manager import EspRequest, GlobalManager
from jserve.sim.trace import TraceRequest


class ToyCosts:
    """prefill: 1 ms per extra instance (ring set-up) + quadratic work split over d;
    migrate: ``per_token`` s a token between distinct instances; decode on one instance:
    10 ms + 1 ms a master row (linear layers) + ``attn`` s a KV token held (attention)."""

    def __init__(self, per_token: float = 1e-5, attn: float = 1e-6):
        self.per_token, self.attn = per_token, attn

    def prefill(self, lengths, degree):
        return 0.001 * (degree - 1) + sum(n * n for n in lengths) * 1e-7 / degree

    def migrate(self, tokens, src, dst):
        return 0.0 if src == dst or tokens <= 0 else tokens * self.per_token

    def node_of(self, instance):
        return 0

    def decode_instance(self, masters, pieces):
        return (0.010 + 0.001 * masters if masters else 0.0) + self.attn * sum(pieces)


def manager(n, capacity, costs=None, **kw) -> GlobalManager:
    return GlobalManager(n, capacity, costs or ToyCosts(), tipping_s=1e9, **kw)


def decoding(gm: GlobalManager, rid: str, where: dict[int, int], *, prompt: int,
             output: int = 1, max_tokens: int = 100, start: float = 0.0) -> EspRequest:
    """A request in its decode phase holding ``where`` KV tokens, mastered on the first."""
    r = EspRequest(rid, prompt, max_tokens, 0.0, output_tokens=output, decode_start_s=start)
    for i, tokens in where.items():
        gm._put(rid, i, tokens)
    gm.master[rid] = next(iter(where))
    return r


@pytest.mark.parametrize("per_token, joins", [(1e-5, True), (1e-4, False)])
def test_scale_up_eq3_gain_against_eq4_migration_cost(per_token, joins):
    costs = ToyCosts(per_token=per_token)
    gm = manager(3, 1000, costs)
    d1 = decoding(gm, "d1", {1: 100}, prompt=90)
    d2 = decoding(gm, "d2", {2: 300}, prompt=290)
    r = EspRequest("r", 400, 10, 0.0)
    # Eq. (3): (T(R, {0}) - T(R, {0, e_min})) / input_len with e_min = instance 1 (100 used).
    t1, t2 = 400 ** 2 * 1e-7, 0.001 + 400 ** 2 * 1e-7 / 2
    gain = (t1 - t2) / 400
    # Eq. (4): V(e_min) / (bandwidth x input_len): 100 tokens to instance 2 (most unused).
    cost = 100 * per_token / 400
    assert (gain > cost) == joins
    (batch,) = gm.step(0.0, [r], [d1, d2])
    if joins:  # instance 2 cannot join after: its 300 tokens have nowhere to go
        assert sorted(batch.instances) == [0, 1]
        assert batch.start_s == pytest.approx(100 * per_token)  # the migration first
        assert batch.end_s == pytest.approx(batch.start_s + t2)
        assert gm.placement["d1"] == {2: 100} and gm.master["d1"] == 2
        assert gm.hold_until["d1"] == pytest.approx(batch.start_s)
    else:
        assert batch.instances == (0,) and batch.start_s == 0.0
        assert batch.end_s == pytest.approx(t1)
        assert gm.placement["d1"] == {1: 100}
    gm.check()


@pytest.mark.parametrize("output_tokens, preempts", [(4, False), (40, True)])
def test_dispatch_preempts_a_decode_instance_by_eq1_cost_against_eq2_gain(output_tokens,
                                                                          preempts):
    gm = manager(2, 1000)
    old = EspRequest("old", 10, 5, 0.0, decode_start_s=0.0)
    gm.release(old, 3.0)  # AvgLat_d = 3 s
    d1 = decoding(gm, "d1", {1: 200}, prompt=150, output=output_tokens, start=1.0)
    a, b = EspRequest("a", 700, 100, 0.0), EspRequest("b", 500, 100, 0.0)
    # b does not fit instance 0 beside a (800 + 600 > 1000), but does with instance 1.
    # Eq. (5) on {0, 1}: apart 0.049 + 0.025 = 0.074 s < together 2 x (0.001 + 0.037).
    t = max(700 ** 2 * 1e-7, 500 ** 2 * 1e-7)
    assert 700 ** 2 * 1e-7 + 500 ** 2 * 1e-7 < 2 * (0.001 + (700 ** 2 + 500 ** 2) * 1e-7 / 2)
    cost = t / output_tokens                      # eq. (1), one decode in B_p
    gain = max(3.0 - (2.0 - 1.0), 0.0) / 500       # eq. (2) at now = 2 s
    assert (gain > cost) == preempts
    pending = [a, b]
    batches = gm.step(2.0, pending, [d1])
    placed = {r.request_id: bt.instances for bt in batches for r in bt.requests}
    if preempts:
        assert placed == {"a": (0,), "b": (1,)} and pending == []
        # Nowhere to migrate d1's KV: it stays, and d1 stalls until b's prefill ends.
        assert gm.placement["d1"] == {1: 200} and gm.prefilling(1, 2.0)
    else:
        assert placed == {"a": (0,)} and pending == [b]
    gm.check()


def test_batching_dp_eq5_gives_the_long_prompt_two_instances_and_the_shorts_one():
    gm = manager(3, 10_000)
    reqs = [EspRequest("s1", 100, 10, 0.0), EspRequest("L", 4000, 10, 0.0),
            EspRequest("s2", 100, 10, 0.0)]
    plan = gm._batch(reqs, [0, 1, 2])
    assert [([r.request_id for r in g], insts) for g, insts in plan] == [
        (["L"], [0, 1]), (["s1", "s2"], [2])]
    # The sum of input latencies it minimizes, by hand, against the other splits:
    best = (0.001 + 4000 ** 2 * 1e-7 / 2) + 2 * (2 * 100 ** 2 * 1e-7)
    all_three = 3 * (0.002 + (4000 ** 2 + 2 * 100 ** 2) * 1e-7 / 3)
    long_alone_one = 4000 ** 2 * 1e-7 + 2 * (0.001 + 2 * 100 ** 2 * 1e-7 / 2)
    assert best < min(all_three, long_alone_one)
    assert sum(gm._latency(reqs, [0, 1, 2])) == pytest.approx(best)


@pytest.mark.parametrize("capacity, kept", [(1000, 1), (600, 2)])
@pytest.mark.parametrize("proactive", [True, False])
def test_scale_down_keeps_the_fewest_instances_and_charges_the_moved_kv(capacity, kept,
                                                                        proactive):
    gm = manager(4, capacity, proactive=proactive)
    r = EspRequest("r", 800, 200, 0.0)  # 1000 KV tokens
    (batch,) = gm.step(0.0, [r], [])
    assert len(batch.instances) == 4  # 3 ms of ring set-up < the 3/4 of 64 ms it saves
    assert batch.end_s == pytest.approx(0.003 + 800 ** 2 * 1e-7 / 4)
    waits = gm.scale_down(batch)
    assert len(gm.placement["r"]) == kept and sum(gm.placement["r"].values()) == 1000
    # Each instance computed 1/4 of the prompt; what the kept ones did not compute travels
    # to them, in parallel into each kept instance.
    moved = 800 * (4 - kept) // 4
    seconds = -(-moved // kept) * 1e-5
    prefill_s = batch.end_s - batch.start_s
    assert waits["r"] == pytest.approx(max(0.0, seconds - prefill_s) if proactive else seconds)
    assert gm.master["r"] in gm.placement["r"]
    gm.check()


def test_multi_master_decode_runs_linear_layers_on_the_master_only():
    costs = ToyCosts()
    gm = manager(2, 10_000, costs)
    r = decoding(gm, "r", {0: 3000, 1: 1000}, prompt=3999, output=1)  # context 4000
    # Master 0: one row of linear layers + attention over 3000 tokens; instance 1: attention
    # over its 1000-token piece only.
    expected = max(0.010 + 0.001 + 3000e-6, 1000e-6)
    assert iteration_s(gm, costs, [r]) == pytest.approx(expected)
    charged_twice = max(0.011 + 3000e-6, 0.011 + 1000e-6)  # a full row on each instance
    assert expected == pytest.approx(charged_twice)  # the slower one decides ...
    s = decoding(gm, "s", {1: 500}, prompt=499, output=1)
    # ... until instance 1 masters its own decode: its linear layers count once, not twice.
    assert iteration_s(gm, costs, [r, s]) == pytest.approx(
        max(0.011 + 3000e-6, 0.011 + 1000e-6 + 500e-6))


def test_decode_scale_up_moves_half_the_masters_to_an_idle_instance_without_migration():
    costs = ToyCosts()
    gm = manager(2, 10_000, costs, decode_batch_threshold=2)
    reqs = [decoding(gm, f"d{k}", {0: 1000}, prompt=900, output=k + 1, max_tokens=100)
            for k in range(5)]
    contexts = [901, 902, 903, 904, 905]  # prompt + output so far
    before = iteration_s(gm, costs, reqs)
    assert before == pytest.approx(0.010 + 0.005 + sum(contexts) * 1e-6)
    assert gm.scale_up_decodes(0.0, reqs) == [1]
    # The two with the most output left (d0: 99, d1: 98) get instance 1 as master; their
    # unwritten reservation (99 and 98 tokens) moves there, nothing written does.
    assert {rid for rid, m in gm.master.items() if m == 1} == {"d0", "d1"}
    assert gm.placement["d0"] == {0: 1000 - 99, 1: 99}
    assert gm.placement["d1"] == {0: 1000 - 98, 1: 98}
    assert gm.migrations == []
    # Attention: each instance reads the context in proportion to the KV it holds.
    on_1 = 901 * 99 // 1000 + 902 * 98 // 1000
    on_0 = 901 * 901 // 1000 + 902 * 902 // 1000 + 903 + 904 + 905
    after = iteration_s(gm, costs, reqs)
    assert after == pytest.approx(max(0.010 + 0.003 + on_0 * 1e-6, 0.010 + 0.002 + on_1 * 1e-6))
    assert after < before
    gm.check()
    assert gm.scale_up_decodes(0.0, reqs) == []  # 3 masters > 2, but no idle instance left


def test_an_idle_instance_starts_a_short_prefill_before_a_busy_one_ends_its_decode_round():
    costs = ToyCosts(attn=1e-5)
    gm = manager(2, 30_000, costs)
    arrive = 20.5
    trace = [TraceRequest("long", 0.0, 20_000, 40), TraceRequest("short", arrive, 100, 2)]
    recs = {r["request_id"]: r for r in simulate_loongserve(trace, costs, 2, manager=gm,
                                                            check=True)}
    long, short = recs["long"], recs["short"]
    # The long prompt prefilled on both instances, then scaled down to one (its KV fits):
    # its decode rounds take 10 + 1 ms + 1e-5 s x ~20K context ~ 0.21 s each.
    prefill = 0.001 + 20_000 ** 2 * 1e-7 / 2
    assert long["first_token_s"] == pytest.approx(prefill)
    rounds = long["token_times_s"]
    end = next(t for t in rounds if t > arrive)  # the round running when the short arrives
    start = max(t for t in rounds if t <= arrive)
    assert end - start == pytest.approx(0.011 + 1e-5 * (20_000 + rounds.index(start)), rel=0.01)
    # The idle instance prefills the short at its arrival, not at the round's end.
    assert short["first_token_s"] == pytest.approx(arrive + 100 ** 2 * 1e-7)
    assert short["first_token_s"] < end
    # And its decodes run on their own clock (10 + 1 ms + 0.1 ms each), not the long's.
    assert short["token_times_s"][1] - short["token_times_s"][0] == pytest.approx(
        0.011 + 1e-5 * 101)
    assert sum(gm.used) == 0 and gm.placement == {}

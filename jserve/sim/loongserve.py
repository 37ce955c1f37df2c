"""Discrete-event run of the LoongServe baseline: every elastic instance keeps its own clock.
Prefill batches run on their ESP groups while the other instances decode, and each decode
group (the instances sharing decoding requests' KV, §4.2 multi-master decoding) iterates
as soon as its own previous iteration ends, independently of the others; an instance with
nothing to do starts a prefill the moment one is dispatched. The one-plan-per-iteration
simulator of ``jserve.sim.simulator`` cannot express this. Decisions are ``GlobalManager``'s
(``jserve.sim.loongserve_manager``); times are ``EspCosts``' (``jserve.sim.esp``). Records are
the simulator's (``jserve.sim.trace``).

At each event (an arrival, the end of a prefill batch or of a decode iteration, a migration
landing): admit arrivals, finish prefill batches (first token at the batch's end, then
scale-down), finish decode iterations (one token each), let the manager dispatch new prefill
batches and scale decode groups up, then start an iteration on every decode group whose
instances are all free. A decode iteration lasts as long as its slowest instance (each
instance: the linear layers of the requests it masters plus attention over the KV pieces it
holds).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterable

from jserve.sim.esp import EspCosts
from jserve.sim.loongserve_manager import EspRequest, GlobalManager, PrefillBatch
from jserve.sim.trace import TraceRequest, empty_record

POLICY = "loongserve"


def tipping_point_s(costs: EspCosts, ratio: float = 1.1) -> float:
    """§5.1's tipping point: the time of the smallest single-instance prefill batch whose
    per-token time is within ``ratio`` of a 32K-token batch's (compute-bound). Batches are
    512-token prompts, so attention stays small and the matmuls decide."""
    def batch(n: int) -> tuple[int, ...]:
        return (n,) if n < 512 else (512,) * (n // 512)

    big = 32_768
    per_token = costs.prefill(batch(big), 1) / big
    n = 128
    while n < big and costs.prefill(batch(n), 1) / n > ratio * per_token:
        n *= 2
    return costs.prefill(batch(n), 1)


def decode_groups(gm: GlobalManager, decoding: Iterable[EspRequest]
                  ) -> list[tuple[list[int], list[EspRequest]]]:
    """Connected components of instances linked by the decoding requests whose KV they
    share: each is one multi-master decode group, iterating on its own clock."""
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent.setdefault(i, i) != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    reqs = list(decoding)
    for r in reqs:
        first, *rest = gm.placement[r.request_id]
        root(first)
        for i in rest:
            parent[root(i)] = root(first)
    groups: dict[int, tuple[list[int], list[EspRequest]]] = {}
    for i in sorted(parent):
        groups.setdefault(root(i), ([], []))[0].append(i)
    for r in reqs:
        groups[root(next(iter(gm.placement[r.request_id])))][1].append(r)
    return list(groups.values())


def iteration_s(gm: GlobalManager, costs, reqs: Iterable[EspRequest]) -> float:
    """One multi-master decode iteration of ``reqs``: its slowest instance's time (linear
    layers of its masters, attention over the KV pieces it holds)."""
    masters: dict[int, int] = {}
    pieces: dict[int, list[int]] = {}
    for r in reqs:
        where = gm.placement[r.request_id]
        masters[gm.master[r.request_id]] = masters.get(gm.master[r.request_id], 0) + 1
        context = r.prompt_tokens + r.output_tokens
        total = sum(where.values())
        for i, tokens in where.items():
            pieces.setdefault(i, []).append(max(1, context * tokens // total))
    return max(costs.decode_instance(masters.get(i, 0), tuple(p)) for i, p in pieces.items())


def _decode_iterations(gm: GlobalManager, costs: EspCosts, decoding: dict[str, EspRequest],
                       in_flight: set[str], now: float) -> list[tuple[float, list[EspRequest]]]:
    """The decode iterations that start at ``now``: (end, requests) per instance group whose
    instances are all free, with its requests that may step (not in an iteration, not held,
    none of their instances prefilling); the groups' instances are busy until the end."""
    def ready(r: EspRequest) -> bool:
        return (r.request_id not in in_flight
                and gm.hold_until.get(r.request_id, now) <= now
                and not any(gm.prefilling(i, now) for i in gm.placement[r.request_id]))
    out = []
    for insts, reqs in decode_groups(gm, decoding.values()):
        if any(gm.decode_until[i] > now for i in insts):
            continue  # part of the group is still in its previous iteration
        stepping = [r for r in reqs if ready(r)]
        if not stepping:
            continue
        end = now + iteration_s(gm, costs, stepping)
        for i in {i for r in stepping for i in gm.placement[r.request_id]}:
            gm.decode_until[i] = end
        out.append((end, stepping))
    return out


def simulate_loongserve(trace: Iterable[TraceRequest], costs: EspCosts, num_instances: int, *,
                        memory_fraction: float = 0.9, horizon_s: float | None = None,
                        proactive: bool = True, check: bool = False,
                        decode_scale_up: bool = True,
                        manager: GlobalManager | None = None) -> list[dict]:
    """Runs ``trace`` until all requests finish (or ``horizon_s``); one record per request in
    arrival order. A request whose KV exceeds the whole pool is aborted on arrival;
    ``check`` verifies KV conservation after every event."""
    pending_trace = sorted(trace, key=lambda t: t.arrival_s)
    records = {t.request_id: empty_record(t, POLICY) for t in pending_trace}
    gm = manager or GlobalManager(
        num_instances, costs.capacity_tokens(memory_fraction), costs,
        tipping_s=tipping_point_s(costs), proactive=proactive,
        decode_batch_threshold=costs.decode_batch_threshold() if decode_scale_up else None)
    pending: list[EspRequest] = []
    decoding: dict[str, EspRequest] = {}
    in_flight: set[str] = set()  # decodes inside a running iteration
    events: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
    seq = itertools.count()
    now, a = 0.0, 0

    def emit(r: EspRequest, at: float) -> None:
        rec = records[r.request_id]
        r.output_tokens += 1
        rec["output_tokens"] += 1
        rec["token_times_s"].append(at)
        if rec["first_token_s"] is None:
            rec["first_token_s"] = at
        if r.output_tokens >= r.max_tokens:
            rec["finish_s"], rec["finish_reason"] = at, "length"
            decoding.pop(r.request_id, None)
            gm.release(r, at)

    while True:
        while a < len(pending_trace) and pending_trace[a].arrival_s <= now:
            t = pending_trace[a]
            a += 1
            r = EspRequest(t.request_id, t.prompt_tokens, t.output_tokens, t.arrival_s)
            if r.kv_tokens > gm.capacity * gm.n:
                records[t.request_id]["finish_reason"] = "abort"
                continue
            pending.append(r)
        while events and events[0][0] <= now:
            end, _, kind, payload = heapq.heappop(events)
            if kind == "prefill":
                batch: PrefillBatch = payload  # type: ignore[assignment]
                gm.scale_down(batch)
                for r in batch.requests:
                    r.decode_start_s = end
                    emit(r, end)  # the prefill samples the first token
                    if r.output_tokens < r.max_tokens:
                        decoding[r.request_id] = r
            elif kind == "decode":
                for r in payload:  # type: ignore[union-attr]
                    in_flight.discard(r.request_id)
                    emit(r, end)
        if horizon_s is not None and now >= horizon_s:
            break
        for batch in gm.step(now, pending, list(decoding.values())):
            heapq.heappush(events, (batch.end_s, next(seq), "prefill", batch))
        gm.scale_up_decodes(now, list(decoding.values()))
        if check:
            gm.check()
        for end, stepping in _decode_iterations(gm, costs, decoding, in_flight, now):
            in_flight.update(r.request_id for r in stepping)
            heapq.heappush(events, (end, next(seq), "decode", stepping))
        upcoming = [events[0][0]] if events else []
        if a < len(pending_trace):
            upcoming.append(pending_trace[a].arrival_s)
        upcoming += [t for t in gm.hold_until.values() if t > now]
        upcoming += [t for t in gm.busy_until if t > now]
        if not upcoming:
            if pending or decoding:
                raise RuntimeError(f"{POLICY}: no progress possible at t={now:.3f}s")
            break
        now = min(upcoming)
    if check:
        gm.check()
    return [records[t.request_id] for t in pending_trace]

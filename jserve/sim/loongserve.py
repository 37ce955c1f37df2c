"""Discrete-event run of the LoongServe baseline: prefill batches run on their ESP groups
while every other instance keeps decoding, which the one-plan-per-iteration simulator of
``jserve.sim.simulator`` cannot express. Decisions are ``GlobalManager``'s; times are
``EspCosts``'. Records are the simulator's (``jserve.sim.trace``).

The loop: admit arrivals, finish prefill batches that have ended (first token at the batch's
end, then scale-down), let the manager start new prefill batches, then run one decode round
on the instances not prefilling. Simplification: decode instances step in lock-step (a round
lasts as long as the slowest instance's iteration); LoongServe runs its decode batches
asynchronously, so a decode here may wait up to one round more.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterable

from jserve.scheduler.loongserve import EspRequest, GlobalManager, PrefillBatch
from jserve.sim.esp import EspCosts
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


def simulate_loongserve(trace: Iterable[TraceRequest], costs: EspCosts, num_instances: int, *,
                        memory_fraction: float = 0.9, horizon_s: float | None = None,
                        proactive: bool = True, check: bool = False,
                        manager: GlobalManager | None = None) -> list[dict]:
    """Runs ``trace`` until all requests finish (or ``horizon_s``); one record per request in
    arrival order. A request whose KV exceeds the whole pool is aborted on arrival;
    ``check`` verifies KV conservation after every event."""
    pending_trace = sorted(trace, key=lambda t: t.arrival_s)
    records = {t.request_id: empty_record(t, POLICY) for t in pending_trace}
    gm = manager or GlobalManager(num_instances, costs.capacity_tokens(memory_fraction), costs,
                                  tipping_s=tipping_point_s(costs), proactive=proactive)
    pending: list[EspRequest] = []
    decoding: dict[str, EspRequest] = {}
    ready_at: dict[str, float] = {}  # a decode may not step before (migration, scale-down)
    running: list[tuple[float, int, PrefillBatch]] = []  # heap by end time
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
            ready_at.pop(r.request_id, None)
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
        while running and running[0][0] <= now:
            end, _, batch = heapq.heappop(running)
            waits = gm.scale_down(batch)
            for r in batch.requests:
                r.decode_start_s = end
                emit(r, end)  # the prefill samples the first token
                if r.output_tokens < r.max_tokens:
                    decoding[r.request_id] = r
                    ready_at[r.request_id] = end + waits[r.request_id]
        if horizon_s is not None and now >= horizon_s:
            break
        for batch in gm.step(now, pending, list(decoding.values())):
            heapq.heappush(running, (batch.end_s, next(seq), batch))
        if check:
            gm.check()
        # Decodes whose KV sits only on instances not prefilling run one round.
        rows: dict[int, list[int]] = {}
        stepping = []
        for rid, r in decoding.items():
            where = gm.placement[rid]
            if ready_at[rid] > now or any(gm.prefilling(i, now) for i in where):
                continue
            stepping.append(r)
            context = r.prompt_tokens + r.output_tokens
            total = sum(where.values())
            for i, tokens in where.items():
                rows.setdefault(i, []).append(max(1, context * tokens // total))
        if stepping:
            now += max(costs.decode(tuple(c)) for c in rows.values())
            for r in stepping:
                emit(r, now)
            continue
        events = [running[0][0]] if running else []
        if a < len(pending_trace):
            events.append(pending_trace[a].arrival_s)
        events += [t for t in ready_at.values() if t > now]
        events += [gm.busy_until[i] for i in range(gm.n) if gm.busy_until[i] > now]
        if not events:
            if pending or decoding:
                raise RuntimeError(f"{POLICY}: no progress possible at t={now:.3f}s")
            break
        now = min(events)
    if check:
        gm.check()
    return [records[t.request_id] for t in pending_trace]

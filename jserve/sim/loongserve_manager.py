"""LoongServe's global manager (Wu et al., SOSP 2024): the baseline Medha compares against,
rule by rule from the paper, over a unified token-granular KV pool spread on n elastic
instances. Pure Python; the costs come from an ``EspCosts``-like object (``jserve.sim.esp``)
and the event-driven simulator (``jserve.sim.loongserve``) runs the decisions. It lives in
``jserve.sim`` because only the simulator uses it (the live engine has no elastic instances).

Each call of ``step`` is one iteration of the manager (§5, four steps):

1. Dispatching (§5.1). The pending queue is scanned FCFS. A request joins the prefill set
   R_p only if the unused KV slots of the instances E_p (initially every idle instance) hold
   its maximum future KV (prompt + maximum output, so it is never evicted). The scan stops
   once the predicted iteration time T(R_p, E_p) passes the tipping point where prefill
   turns compute-bound (``tipping_s``), and at the first request that does not fit (FCFS: no
   overtaking). A later request may take a decode instance when eq. (2)'s gain beats eq.
   (1)'s cost. Simplification: when the *head* request does not fit the idle instances it
   takes decode instances by §5.2's preemption rule instead (most unused slots first, their
   KV migrated away), so a long prefill never waits for short decodes to finish.
2. Elastic instance allocation (§5.2). The decode instance with the fewest used slots
   e_min joins E_p while eq. (3)'s prefill-latency gain beats eq. (4)'s migration cost and
   its KV fits on the other decode instances. KV on instances taken for prefill is migrated
   (at ``costs.migrate``) to the decode instances with the most unused slots; the prefill
   starts when the taken instances have finished their running decode iteration and the
   last byte has left. What cannot move stays and its decodes stall.
3. Batching (§5.3). The dynamic programme of eq. (5): requests by length descending,
   instances by (node, unused slots), f[i][k] = min f[j][l] + T(R[j:i], E[l:k]) with the
   batch's tokens within the instances' unused slots; T sums the batch's requests' latency.
   Not every instance of E_p need be used (min over k of f[n][k]).
4. Scaling (§5.4). After its prefill a request scales down to the fewest instances of its
   group that hold its KV (most unused slots first). The KV that ends away from where it
   was computed costs ``costs.migrate``; proactive migration (§4.1) overlaps it with the
   prefill, so only what exceeds the prefill's duration delays the first decode.
   Decodes use multi-master decoding (§4.2): each request has one *master* instance that
   runs its linear layers and stores its new KV; the other instances holding its KV run
   attention on their piece only. Decode scale-up (§4.2, §5.4): when an instance masters more
   decodes than the batch-size threshold where decoding turns compute-bound, an idle
   instance joins as a new master for half of them; their not-yet-written KV reservation
   moves there (nothing written moves: zero-overhead scale-up).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol, Sequence


@dataclasses.dataclass
class EspRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    output_tokens: int = 0
    decode_start_s: float | None = None

    @property
    def kv_tokens(self) -> int:
        """The request's maximum future KV (§5.1): what the manager reserves for it."""
        return self.prompt_tokens + self.max_tokens


@dataclasses.dataclass(frozen=True)
class PrefillBatch:
    requests: tuple[EspRequest, ...]
    instances: tuple[int, ...]
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class Migration:
    request_id: str
    src: int
    dst: int
    tokens: int
    seconds: float
    reason: str  # "preempt" (§5.2) or "scale-down" (§4.1)


class Costs(Protocol):
    def prefill(self, lengths: tuple[int, ...], degree: int) -> float: ...
    def migrate(self, tokens: int, src: int, dst: int) -> float: ...
    def node_of(self, instance: int) -> int: ...


class GlobalManager:
    def __init__(self, num_instances: int, capacity_tokens: int, costs: Costs, *,
                 tipping_s: float, proactive: bool = True,
                 decode_batch_threshold: int | None = None):
        if num_instances < 1 or capacity_tokens < 1:
            raise ValueError("num_instances and capacity_tokens must be >= 1")
        if decode_batch_threshold is not None and decode_batch_threshold < 1:
            raise ValueError("decode_batch_threshold must be >= 1 (None: no decode scale-up)")
        self.n, self.capacity, self.costs = num_instances, capacity_tokens, costs
        self.tipping_s, self.proactive = tipping_s, proactive
        self.decode_batch_threshold = decode_batch_threshold
        self.used = [0] * num_instances
        self.busy_until = [-math.inf] * num_instances  # end of the prefill batch it runs
        # End of the decode iteration it runs (the simulator sets it): a prefill that takes
        # a decode instance starts after that iteration, at its boundary.
        self.decode_until = [-math.inf] * num_instances
        self.master: dict[str, int] = {}  # decoding request -> its master instance (§4.2)
        self.hold_until: dict[str, float] = {}  # a decode's KV is in flight until then
        self.placement: dict[str, dict[int, int]] = {}  # request -> instance -> KV tokens
        self.migrations: list[Migration] = []
        self._decode_times: list[float] = []  # decode phases of finished requests (AvgLat_d)

    # -- the pool -------------------------------------------------------------------------
    def free(self, i: int) -> int:
        return self.capacity - self.used[i]

    def prefilling(self, i: int, now: float) -> bool:
        return self.busy_until[i] > now

    def _put(self, rid: str, i: int, tokens: int) -> None:
        if tokens <= 0:
            return
        if tokens > self.free(i):
            raise RuntimeError(f"instance {i}: {tokens} KV tokens over {self.free(i)} free")
        self.used[i] += tokens
        where = self.placement.setdefault(rid, {})
        where[i] = where.get(i, 0) + tokens

    def _take(self, rid: str, i: int, tokens: int) -> None:
        where = self.placement[rid]
        where[i] -= tokens
        self.used[i] -= tokens
        if not where[i]:
            del where[i]

    def masters_on(self, i: int) -> list[str]:
        return [rid for rid, m in self.master.items() if m == i]

    def release(self, req: EspRequest, now: float) -> None:
        """``req`` finished: free its KV; its decode phase joins AvgLat_d."""
        for i, tokens in self.placement.pop(req.request_id, {}).items():
            self.used[i] -= tokens
        self.master.pop(req.request_id, None)
        self.hold_until.pop(req.request_id, None)
        if req.decode_start_s is not None:
            self._decode_times.append(now - req.decode_start_s)

    def check(self) -> None:
        """KV conservation: every instance's used slots are the sum of what it holds."""
        held = [0] * self.n
        for where in self.placement.values():
            for i, tokens in where.items():
                held[i] += tokens
        if held != self.used or any(u > self.capacity or u < 0 for u in self.used):
            raise AssertionError(f"KV pool out of balance: used {self.used}, held {held}")
        for rid, m in self.master.items():
            if m not in self.placement.get(rid, {}):
                raise AssertionError(f"{rid}: master {m} holds none of its KV")

    # -- the four steps ---------------------------------------------------------------------
    def step(self, now: float, pending: list[EspRequest],
             decoding: Sequence[EspRequest]) -> list[PrefillBatch]:
        """Dispatch from ``pending`` (removing what starts) and start prefill batches."""
        if not pending:
            return []
        idle = [i for i in range(self.n) if not self.prefilling(i, now) and not self.used[i]]
        taken = self._dispatch(now, pending, idle, decoding)
        if taken is None:
            return []
        reqs, instances = taken
        instances = self._scale_up(now, reqs, instances)
        # Taken decode instances join at the end of the decode iteration they are running.
        start = max([now] + [self.decode_until[i] for i in instances])
        start += self._evacuate(now, instances, start)
        batches = []
        for group, insts in self._batch(reqs, instances):
            end = start + self.costs.prefill(tuple(r.prompt_tokens for r in group), len(insts))
            for r in group:
                self._spread(r, insts)
            for i in insts:
                self.busy_until[i] = end
            batches.append(PrefillBatch(tuple(group), tuple(insts), start, end))
        for r in reqs:
            pending.remove(r)
        return batches

    def _fits(self, reqs: Sequence[EspRequest], instances: Sequence[int]) -> bool:
        return sum(r.kv_tokens for r in reqs) <= sum(self.free(i) for i in instances)

    def _decode_instances(self, now: float, exclude: Sequence[int]) -> list[int]:
        """Instances running decodes, most unused slots first."""
        return sorted((i for i in range(self.n) if i not in exclude
                       and not self.prefilling(i, now) and self.used[i]),
                      key=lambda i: (-self.free(i), i))

    def _dispatch(self, now: float, pending: list[EspRequest], idle: list[int],
                  decoding: Sequence[EspRequest]) -> tuple[list, list[int]] | None:
        """§5.1: R_p and the instances E_p it may use."""
        reqs: list[EspRequest] = []
        instances = list(idle)
        for r in pending:
            if reqs and max(self._latency(reqs, instances)) > self.tipping_s:
                break
            if self._fits(reqs + [r], instances):
                reqs.append(r)
                continue
            extra = self._head_takes(now, r, instances) if not reqs else \
                self._worth_preempting(now, reqs, r, instances, decoding)
            if extra is None:
                break
            instances += extra
            reqs.append(r)
        return (reqs, instances) if reqs else None

    def _head_takes(self, now: float, r: EspRequest, instances: list[int]) -> list[int] | None:
        """§5.2 preemption for the head request: decode instances with the most unused
        slots until its KV fits (their decodes are migrated away or stall)."""
        extra: list[int] = []
        for i in self._decode_instances(now, instances):
            extra.append(i)
            if self._fits([r], instances + extra):
                return extra
        return None

    def _worth_preempting(self, now: float, reqs: list[EspRequest], r: EspRequest,
                          instances: list[int], decoding: Sequence[EspRequest]
                          ) -> list[int] | None:
        """§5.1 eqs. (1)-(2): take one decode instance G for ``r`` if the gain in r's
        normalized input latency beats the stall its decodes suffer."""
        avg = sum(self._decode_times) / len(self._decode_times) if self._decode_times else 0.0
        on = {i: [d for d in decoding if i in self.placement.get(d.request_id, {})]
              for i in self._decode_instances(now, instances)}
        for g, batch in on.items():
            if not self._fits(reqs + [r], instances + [g]):
                continue
            elapsed = min((now - d.decode_start_s for d in batch
                           if d.decode_start_s is not None), default=0.0)
            gain = max(avg - elapsed, 0.0) / r.prompt_tokens
            t = max(self._latency(reqs + [r], instances + [g]))
            cost = sum(t / max(d.output_tokens, 1) for d in batch)
            return [g] if gain > cost else None
        return None

    def _scale_up(self, now: float, reqs: list[EspRequest], instances: list[int]) -> list[int]:
        """§5.2 eqs. (3)-(4): add e_min while the prefill gain beats its migration cost."""
        instances = list(instances)
        while True:
            others = self._decode_instances(now, instances)
            if not others:
                return instances
            e = min(others, key=lambda i: (self.used[i], i))
            targets = [i for i in others if i != e]
            if self.used[e] > sum(self.free(i) for i in targets):
                return instances  # its KV has nowhere to go
            before, after = self._latency(reqs, instances), self._latency(reqs, instances + [e])
            dst = targets[0] if targets else e
            seconds = self.costs.migrate(self.used[e], e, dst)
            gain = sum((b - a) / r.prompt_tokens for b, a, r in zip(before, after, reqs))
            cost = sum(seconds / r.prompt_tokens for r in reqs)
            if gain <= cost:
                return instances
            instances.append(e)

    def _evacuate(self, now: float, instances: list[int], start: float = 0.0) -> float:
        """Migrate decode KV off ``instances`` (from ``start``, when their decode iteration
        has ended) to other decode (or idle) instances with the most unused slots; returns
        the seconds until the last piece has left. A moved decode steps again only then,
        and a master whose KV left follows its largest piece."""
        longest = 0.0
        moved_requests: set[str] = set()
        for e in instances:
            if not self.used[e]:
                continue
            moved: dict[int, int] = {}
            for rid in [rid for rid, w in self.placement.items() if e in w]:
                tokens = self.placement[rid][e]
                dsts = sorted((i for i in range(self.n) if i not in instances
                               and not self.prefilling(i, now)),
                              key=lambda i: (-self.free(i), i))
                for dst in dsts:
                    if not tokens:
                        break
                    n = min(tokens, self.free(dst))
                    if n <= 0:
                        continue
                    self._take(rid, e, n)
                    self._put(rid, dst, n)
                    moved[dst] = moved.get(dst, 0) + n
                    tokens -= n
                    moved_requests.add(rid)
                    self.migrations.append(Migration(rid, e, dst, n,
                                                     self.costs.migrate(n, e, dst), "preempt"))
            # One source sends to its destinations one after another.
            longest = max(longest, sum(self.costs.migrate(n, e, d) for d, n in moved.items()))
        for rid in moved_requests:
            self.hold_until[rid] = max(self.hold_until.get(rid, -math.inf), start + longest)
            where = self.placement[rid]
            if rid in self.master and self.master[rid] not in where:
                self.master[rid] = max(where, key=lambda i: (where[i], -i))
        return longest

    def _latency(self, reqs: Sequence[EspRequest], instances: Sequence[int]) -> list[float]:
        """Each request's prefill latency under the batching plan of §5.3."""
        lat = {}
        for group, insts in self._batch(reqs, instances):
            t = self.costs.prefill(tuple(r.prompt_tokens for r in group), len(insts))
            for r in group:
                lat[r.request_id] = t
        return [lat.get(r.request_id, math.inf) for r in reqs]

    def _batch(self, reqs: Sequence[EspRequest], instances: Sequence[int]
               ) -> list[tuple[list[EspRequest], list[int]]]:
        """§5.3 eq. (5): split length-sorted requests and sorted instances into batches
        minimizing the sum of input latencies under each batch's KV slots."""
        rs = sorted(reqs, key=lambda r: -r.prompt_tokens)
        es = sorted(instances, key=lambda i: (self.costs.node_of(i), -self.free(i), i))
        n, m = len(rs), len(es)
        dem = [0]
        for r in rs:
            dem.append(dem[-1] + r.kv_tokens)
        cap = [0]
        for i in es:
            cap.append(cap[-1] + self.free(i))
        f = [[math.inf] * (m + 1) for _ in range(n + 1)]
        back: dict[tuple[int, int], tuple[int, int]] = {}
        f[0][0] = 0.0
        for i in range(1, n + 1):
            for k in range(1, m + 1):
                for j in range(i):
                    lengths = tuple(r.prompt_tokens for r in rs[j:i])
                    for l in range(k):
                        if f[j][l] == math.inf or dem[i] - dem[j] > cap[k] - cap[l]:
                            continue
                        v = f[j][l] + (i - j) * self.costs.prefill(lengths, k - l)
                        if v < f[i][k]:
                            f[i][k], back[(i, k)] = v, (j, l)
        k = min(range(m + 1), key=lambda k: f[n][k])
        if f[n][k] == math.inf:
            raise RuntimeError("dispatched requests do not fit their instances")
        out = []
        i = n
        while i:
            j, l = back[(i, k)]
            out.append((rs[j:i], es[l:k]))
            i, k = j, l
        return out[::-1]

    def _spread(self, r: EspRequest, instances: Sequence[int]) -> None:
        """Reserve r's KV over ``instances``, evenly where slots allow (water-filling, the
        fullest instance first)."""
        left = r.kv_tokens
        for pos, i in enumerate(sorted(instances, key=lambda i: self.free(i))):
            n = min(self.free(i), -(-left // (len(instances) - pos)))
            self._put(r.request_id, i, n)
            left -= n
        if left:
            raise RuntimeError(f"{r.request_id}: {left} KV tokens found no slot")

    def scale_down(self, batch: PrefillBatch) -> dict[str, float]:
        """§5.4 / §4.1 after ``batch``'s prefill: each request keeps its KV on the fewest
        instances of its group; returns the seconds each request's first decode waits for
        the migration (what proactive migration could not hide under the prefill)."""
        prefill_s = batch.end_s - batch.start_s
        d = len(batch.instances)
        waits = {}
        for r in batch.requests:
            where = dict(self.placement[r.request_id])
            keep: list[int] = []
            room = 0
            for i in sorted(batch.instances, key=lambda i: (-(self.free(i) + where.get(i, 0)),
                                                              i)):
                keep.append(i)
                room += self.free(i) + where.get(i, 0)
                if room >= r.kv_tokens:
                    break
            for i, tokens in where.items():
                self._take(r.request_id, i, tokens)
            self._spread(r, keep)
            # Each instance computed 1 / d of the prompt's KV; what the kept ones did not
            # compute travels to them, in parallel into each kept instance.
            seconds = 0.0
            if len(keep) < d:
                moved = r.prompt_tokens * (d - len(keep)) // d
                src = next(i for i in batch.instances if i not in keep)
                seconds = max(self.costs.migrate(-(-moved // len(keep)), src, dst)
                              for dst in keep)
                self.migrations.append(Migration(r.request_id, src, keep[0], moved, seconds,
                                                 "scale-down"))
            waits[r.request_id] = max(0.0, seconds - prefill_s) if self.proactive else seconds
            # Multi-master: new KV is spread as evenly as possible over the masters (§5.4).
            self.master[r.request_id] = min(keep, key=lambda i: (len(self.masters_on(i)),
                                                                 -self.free(i), i))
            self.hold_until[r.request_id] = batch.end_s + waits[r.request_id]
        return waits

    def scale_up_decodes(self, now: float, decoding: Sequence[EspRequest]) -> list[int]:
        """§4.2 / §5.4 decode scale-up: while an instance (not prefilling) masters more
        decodes than ``decode_batch_threshold`` and an idle instance exists, the idle one
        becomes master of half of them (those with the most output left). Only their
        unwritten KV reservation moves, so no KV is migrated. Returns the instances added."""
        if self.decode_batch_threshold is None:
            return []
        left = {r.request_id: r.max_tokens - r.output_tokens for r in decoding}
        added = []
        for i in range(self.n):
            mine = [rid for rid in self.masters_on(i) if rid in left]
            if self.prefilling(i, now) or len(mine) <= self.decode_batch_threshold:
                continue
            idle = [e for e in range(self.n) if not self.used[e] and not self.prefilling(e, now)]
            if not idle:
                break
            e = idle[0]
            mine.sort(key=lambda rid: (-left[rid], rid))
            for rid in mine[:len(mine) // 2]:
                n = min(left[rid], self.placement[rid].get(i, 0), self.free(e))
                self._take(rid, i, n)
                self._put(rid, e, n)
                if n or e in self.placement[rid]:
                    self.master[rid] = e
            added.append(e)
        return added

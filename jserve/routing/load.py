"""What one replica reports to a router, and the wait it predicts from that report.

A ``ReplicaLoad`` is plain data (JSON round trip: ``to_dict`` / ``from_dict``), so it crosses a
process boundary (HTTP ``/v1/route/load``, Ray Serve's routing stats) unchanged. It carries
the replica's queue of unfinished prefills, each as (seconds until its TTFT deadline, seconds
of isolated prefill work left), and the replica's isolated prefill-time function T(n) as a
small table: the same ``PrefillTimeCache`` LARS ranks and times requests with (or, for a
policy without a predictor, the engine's estimate). From those ``predicted_ttft`` answers
"what would a request of n tokens, k of them cached here, wait here": its own uncached prefill
T(n) - T(k) plus the work the replica would run before it. A FIFO replica (``sarathi``,
``fcfs``, ``sprpt``) runs every queued prefill first; a deadline-ordered one (``edf``, ``lrs``,
``lars``) runs first the prefills whose deadlines come before the newcomer's, and ``lars``
(due-first) runs quick and due prefills before everything, least work first. Either runs them
at the share of each iteration its running decodes leave (``prefill_rate``).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Callable

# TTFT deadline of a request without one (as DeadlineConfig: max(k x isolated prefill, floor)).
TTFT_K = 1.5
TTFT_FLOOR = 0.5
FIFO, DEADLINE_ORDER = "fifo", "deadline"


@dataclasses.dataclass(frozen=True)
class PrefillTable:
    """Isolated prefill time T(n) sampled at ``lengths`` (increasing, starting at 0), linear
    between samples and along the last slope past them; ``drain_s`` is a pipeline's last
    pass, owed once by any request with prompt left."""

    lengths: tuple[int, ...]
    times: tuple[float, ...]
    drain_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.lengths) < 2 or len(self.lengths) != len(self.times) or self.lengths[0]:
            raise ValueError("a PrefillTable needs >= 2 samples starting at length 0")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])):
            raise ValueError("PrefillTable lengths must increase")

    @classmethod
    def sample(cls, time: Callable[[int], float], max_len: int, *, points: int = 48,
               drain_s: float = 0.0) -> "PrefillTable":
        """``time`` at 0 and ``points`` geometrically spaced lengths up to ``max_len``."""
        lengths = sorted({0, *(max(1, round(max_len ** (i / points)))
                               for i in range(1, points + 1))})
        return cls(tuple(lengths), tuple(float(time(n)) for n in lengths), drain_s)

    def time(self, n: int) -> float:
        if n <= 0:
            return 0.0
        ls, ts = self.lengths, self.times
        i = min(max(bisect.bisect_left(ls, n), 1), len(ls) - 1)
        x0, x1, y0, y1 = ls[i - 1], ls[i], ts[i - 1], ts[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def remaining(self, total: int, done: int) -> float:
        """Seconds to the first token of a ``total``-token prompt with ``done`` tokens
        computed or cached, run alone."""
        if total <= done:
            return 0.0
        return self.time(total) - self.time(done) + self.drain_s


@dataclasses.dataclass(frozen=True)
class QueuedPrefill:
    """A request on the replica with prompt left: seconds from the report to its TTFT
    deadline (inf: none), seconds of isolated prefill work left, prompt tokens left."""

    due_s: float
    work_s: float
    tokens: int


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    replica: str
    healthy: bool
    waiting: int                 # requests queued for admission
    running: int                 # requests holding KV pages
    kv_usage: float              # share of KV pages in use, 0..1
    order: str                   # FIFO or DEADLINE_ORDER: who runs before a newcomer
    prefills: tuple[QueuedPrefill, ...]
    table: PrefillTable
    long_threshold: int = 32768  # prompt tokens left that make a prefill "long"
    # The iteration: its time budget (the deadline policies' t_target; else the time of a
    # full token-budget chunk) and the predicted time of the running decodes' share of it.
    # Prefills progress at (1 - decode_s / t_target) of full speed. 0: unknown.
    t_target: float = 0.0
    decode_s: float = 0.0
    # lars with due-first: a prefill with at most this much work left (quick_first x
    # t_target), or one due within an iteration, runs before all others, least work first.
    # 0: no such class (edf, lrs, lars without due-first).
    quick_s: float = 0.0
    max_num_seqs: int = 0        # sequence slots (running requests it may hold); 0: unknown

    @property
    def slots_full(self) -> bool:
        """Every sequence slot taken or promised to a queued request: a newcomer starts only
        once a request here finishes, however short the prefill queue."""
        return 0 < self.max_num_seqs <= self.outstanding

    @property
    def prefill_rate(self) -> float:
        """Share of each iteration left to prefills (at least 5%)."""
        if self.t_target <= 0:
            return 1.0
        return max(1.0 - self.decode_s / self.t_target, 0.05)

    @property
    def outstanding(self) -> int:
        return self.waiting + self.running

    @property
    def queued_work_s(self) -> float:
        return sum(p.work_s for p in self.prefills)

    @property
    def long_prefills(self) -> int:
        return sum(p.tokens >= self.long_threshold for p in self.prefills)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["prefills"] = [[p.due_s if math.isfinite(p.due_s) else None, p.work_s, p.tokens]
                         for p in self.prefills]
        d["table"] = dict(lengths=list(self.table.lengths), times=list(self.table.times),
                          drain_s=self.table.drain_s)
        return d

    @classmethod
    def unknown(cls, replica: str) -> "ReplicaLoad":
        """A replica that has not reported yet: idle as far as anyone knows."""
        return cls(replica, True, 0, 0, 0.0, FIFO, (), PrefillTable((0, 1), (0.0, 0.0)))

    @classmethod
    def from_dict(cls, d: dict) -> "ReplicaLoad":
        t = d["table"]
        return cls(
            replica=str(d["replica"]), healthy=bool(d["healthy"]), waiting=int(d["waiting"]),
            running=int(d["running"]), kv_usage=float(d["kv_usage"]), order=str(d["order"]),
            prefills=tuple(QueuedPrefill(math.inf if due is None else float(due), float(w),
                                         int(n)) for due, w, n in d["prefills"]),
            table=PrefillTable(tuple(t["lengths"]), tuple(t["times"]), float(t["drain_s"])),
            long_threshold=int(d.get("long_threshold", 32768)),
            t_target=float(d.get("t_target", 0.0)), decode_s=float(d.get("decode_s", 0.0)),
            quick_s=float(d.get("quick_s", 0.0)), max_num_seqs=int(d.get("max_num_seqs", 0)))


def default_deadline(own_s: float) -> float:
    """Seconds after arrival a request without a TTFT SLO is due (the deadline policies')."""
    return max(TTFT_K * own_s, TTFT_FLOOR)


def predicted_ttft(load: ReplicaLoad, prompt_tokens: int, cached_tokens: int = 0,
                   ttft_slo: float | None = None) -> float:
    """Seconds from now to the first token of a ``prompt_tokens`` request on this replica,
    ``cached_tokens`` of which it holds in its prefix cache: the replica's work ahead of the
    request plus the request's own uncached prefill, at the speed the running decodes leave
    to prefills."""
    own = load.table.remaining(prompt_tokens, min(cached_tokens, prompt_tokens - 1))
    if load.order == FIFO:
        ahead = load.queued_work_s
    else:
        due = ttft_slo if ttft_slo is not None else default_deadline(
            load.table.remaining(prompt_tokens, 0))

        def first(p: QueuedPrefill) -> bool:  # lars's due-first class
            return load.quick_s > 0 and (p.work_s <= load.quick_s
                                         or 0 <= p.due_s < load.t_target)
        if load.quick_s > 0 and own <= load.quick_s:  # a quick newcomer: least work first
            ahead = sum(p.work_s for p in load.prefills if first(p) and p.work_s <= own)
        else:
            ahead = sum(p.work_s for p in load.prefills if first(p) or p.due_s <= due)
    return (ahead + own) / load.prefill_rate

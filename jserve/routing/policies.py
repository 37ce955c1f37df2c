"""Routing policies: which replica gets a request, as a pure function of the request and the
replicas' reports (``choose``). Nothing here keeps state; ``Router`` only numbers requests
(what round robin needs) so callers need not.

- ``round_robin``: the healthy replicas in turn.
- ``least_load``: fewest outstanding requests (waiting + running), then least KV in use.
- ``prefix``: most prompt tokens already cached there (prefix affinity), then least load.
- ``deadline``: where the request is predicted to meet its TTFT deadline soonest
  (``jserve.routing.load.predicted_ttft``, which already counts a prefix hit as work saved).
  Among the replicas that meet the deadline: a long prompt goes to the one with the fewest long
  prefills (long requests do not pile onto one replica); any other to the soonest first token,
  or, within ``PREFIX_TOLERANCE`` of it, to the one holding the most of the prompt (a prefix
  hit that costs next to nothing). Preferring a hit at any cost short of the deadline was
  measured worse: it piles a shared prefix's requests onto one replica until that replica is
  nearly saturated (docs/scale_out.md). When none meets the deadline: a long prompt goes
  behind the most long prefills (it is late anyway; on FIFO replicas spreading late documents
  leaves no replica free for short requests, measured in docs/scale_out.md), anything else
  to the least late. A replica with all its sequence slots taken (``ReplicaLoad.slots_full``)
  is left out unless every replica is full; then the fewest outstanding requests wins. Ties:
  fewer outstanding requests, less KV in use, lower index.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from jserve.routing.load import ReplicaLoad, default_deadline, predicted_ttft

ROUTERS = ("round_robin", "least_load", "prefix", "deadline")
PREFIX_TOLERANCE = 0.1  # deadline: a prefix hit may cost up to 10% later a first token


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int
    ttft_slo: float | None = None   # seconds after arrival; None: the replicas' default
    seq: int = 0                    # arrival number (round robin's turn)


@dataclasses.dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it for one request: its report and how many of the
    request's prompt tokens its prefix cache holds."""

    load: ReplicaLoad
    cached_tokens: int = 0


def _load_key(v: ReplicaView, i: int) -> tuple:
    return (v.load.outstanding, v.load.kv_usage, i)


def choose(policy: str, request: RouteRequest, views: Sequence[ReplicaView]) -> int:
    """The index in ``views`` of the replica that gets ``request``; ValueError when no replica
    is healthy or the policy is unknown."""
    if policy not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {policy!r}")
    healthy = [i for i, v in enumerate(views) if v.load.healthy]
    if not healthy:
        raise ValueError("no healthy replica to route to")
    if policy == "round_robin":
        return healthy[request.seq % len(healthy)]
    if policy == "least_load":
        return min(healthy, key=lambda i: _load_key(views[i], i))
    if policy == "prefix":
        return min(healthy, key=lambda i: (-views[i].cached_tokens,) + _load_key(views[i], i))
    return _deadline(request, views, healthy)


def _deadline(request: RouteRequest, views: Sequence[ReplicaView], healthy: list[int]) -> int:
    ttft = {i: predicted_ttft(views[i].load, request.prompt_tokens, views[i].cached_tokens,
                              request.ttft_slo) for i in healthy}

    def tie(i: int) -> tuple:
        return _load_key(views[i], i)
    first = views[healthy[0]].load
    due = request.ttft_slo if request.ttft_slo is not None else default_deadline(
        first.table.remaining(request.prompt_tokens, 0))
    # A replica with every sequence slot taken starts nothing new until a request there
    # finishes, which its prefill queue does not show: only where all are full.
    open_ = [i for i in healthy if not views[i].load.slots_full]
    meets = [i for i in open_ if ttft[i] <= due]
    long = request.prompt_tokens >= first.long_threshold
    if not meets and long:
        # Late anyway: queue it behind the most long prefills (least late among those), so
        # the other replicas stay free for requests that can still be on time.
        return min(healthy, key=lambda i: (-views[i].load.long_prefills, ttft[i]) + tie(i))
    if not open_:  # all full: the fewest requests ahead for a slot
        return min(healthy, key=tie)
    if not meets:
        return min(open_, key=lambda i: (ttft[i],) + tie(i))
    if long:
        return min(meets, key=lambda i: (views[i].load.long_prefills, ttft[i]) + tie(i))
    # The soonest first token (a prefix hit already shortens it); within PREFIX_TOLERANCE of
    # the soonest, the replica holding more of the prompt (it keeps the hit for later asks).
    soonest = min(ttft[i] for i in meets)
    near = [i for i in meets if ttft[i] <= soonest * (1 + PREFIX_TOLERANCE)]
    return min(near, key=lambda i: (-views[i].cached_tokens, ttft[i]) + tie(i))


class Router:
    """``choose`` with the arrival numbering round robin needs."""

    def __init__(self, policy: str):
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {policy!r}")
        self.policy = policy
        self._seq = itertools.count()

    def route(self, prompt_tokens: int, views: Sequence[ReplicaView],
              ttft_slo: float | None = None) -> int:
        return choose(self.policy, RouteRequest(prompt_tokens, ttft_slo, next(self._seq)),
                      views)

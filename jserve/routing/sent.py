"""What a router sent each replica since that replica's last report: a report made a moment
before a request reached the replica's queue does not show it. Pure Python, shared by the
routers that read periodic reports (Ray Serve's ``JServeRouter``, ``jserve.serving.front``)."""
from __future__ import annotations

import collections
import dataclasses
import time

from jserve.routing.load import QueuedPrefill, ReplicaLoad, default_deadline

INTAKE_S = 1.0  # seconds a sent request may take to show in its replica's report


class SentLedger:
    def __init__(self, maxlen: int = 1024):
        # Per replica, requests sent, newest last: (wall time, prompt tokens, cached tokens,
        # ttft_slo).
        self._sent: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=maxlen))

    def record(self, replica: str, prompt_tokens: int, cached_tokens: int,
               ttft_slo: float | None) -> None:
        self._sent[replica].append((time.time(), prompt_tokens, cached_tokens, ttft_slo))

    def forget(self, replica: str) -> None:
        self._sent.pop(replica, None)

    def with_unreported(self, load: ReplicaLoad, reported_at: float) -> ReplicaLoad:
        """``load`` plus the requests this router sent the replica that its report may not
        show yet: sent after it, or less than ``INTAKE_S`` before it (a request reaches
        the engine's queue only after the replica has read, templated and tokenized it;
        a report made meanwhile misses it, as a live test saw with a 4,000-token prompt).
        Such a request may be counted twice for that long, which errs toward the other
        replicas."""
        sent = self._sent[load.replica]
        while sent and sent[0][0] <= reported_at - INTAKE_S:
            sent.popleft()
        if not sent:
            return load
        now = time.time()
        extra = tuple(QueuedPrefill(
            (slo if slo is not None else default_deadline(load.table.remaining(n, 0)))
            - (now - t), load.table.remaining(n, cached), n - cached)
            for t, n, cached, slo in sent)
        return dataclasses.replace(load, waiting=load.waiting + len(extra),
                                   prefills=load.prefills + extra)

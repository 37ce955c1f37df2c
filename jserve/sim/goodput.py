"""Goodput: the highest arrival rate a system sustains while it still meets its service
objectives, found by bisection over QPS on one trace (the same requests, arrivals scaled by
1 / QPS). A rate counts as met when each of three attainments reaches ``attainment`` (90%):
short requests' TTFT within a fixed deadline, long requests' TTFT within a deadline
proportional to their isolated prefill time (so a policy cannot buy the shorts' goodput by
starving the long ones), and every request's TPOT within the SLO. Pure Python, no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jserve.bench.metrics import LONG_PROMPT_TOKENS, tpot
from jserve.sim.trace import TraceRequest


@dataclasses.dataclass(frozen=True)
class GoodputSlo:
    short_ttft_s: float = 2.0      # short requests' TTFT deadline (seconds after arrival)
    long_ttft_factor: float = 2.0  # long requests': this x their isolated TTFT
    tpot_s: float = 0.1            # every request's mean time per output token
    attainment: float = 0.9        # the fraction of each class that must meet its objective
    long_prompt_tokens: int = LONG_PROMPT_TOKENS

    def __post_init__(self) -> None:
        if min(self.short_ttft_s, self.long_ttft_factor, self.tpot_s) <= 0:
            raise ValueError("deadlines and the TPOT SLO must be > 0")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")

    def deadlines(self, trace: Sequence[TraceRequest], isolated_ttft_s: Sequence[float]
                  ) -> list[float]:
        """Each request's TTFT deadline: fixed for short prompts, proportional to its
        isolated TTFT for long ones."""
        return [self.long_ttft_factor * alone if t.prompt_tokens >= self.long_prompt_tokens
                else self.short_ttft_s for t, alone in zip(trace, isolated_ttft_s)]


def attainment(records: Sequence[dict], deadlines: Sequence[float], slo: GoodputSlo
               ) -> dict[str, float]:
    """Fractions of short requests within their TTFT deadline, of long ones within theirs,
    and of all requests within the TPOT SLO (a request that never finished misses all it
    had not met; one with a single output token has no TPOT and meets it). A class with no
    request counts as met (1.0)."""
    met: dict[str, list[bool]] = {"short": [], "long": [], "tpot": []}
    for rec, due in zip(records, deadlines, strict=True):
        first = rec["first_token_s"]
        on_time = first is not None and first - rec["arrival_s"] <= due
        met["long" if rec["prompt_tokens"] >= slo.long_prompt_tokens else "short"].append(
            on_time)
        t = tpot(rec)
        met["tpot"].append(t <= slo.tpot_s if t is not None
                           else rec["finish_s"] is not None)
    return {k: sum(v) / len(v) if v else 1.0 for k, v in met.items()}


def meets(records: Sequence[dict], deadlines: Sequence[float], slo: GoodputSlo) -> bool:
    return all(v >= slo.attainment for v in attainment(records, deadlines, slo).values())


def at_rate(trace: Sequence[TraceRequest], qps: float, base_qps: float = 1.0
            ) -> list[TraceRequest]:
    """``trace`` (arrivals drawn at ``base_qps``) replayed at ``qps``: same requests, same
    order, arrival times scaled by base_qps / qps."""
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    return [dataclasses.replace(t, arrival_s=t.arrival_s * base_qps / qps) for t in trace]


def bisect_goodput(ok: Callable[[float], bool], lo: float, hi: float, *,
                   rel_tol: float = 0.05, max_doublings: int = 8) -> float:
    """The highest QPS at which ``ok`` holds, to within ``rel_tol``, assuming it holds below
    some rate and fails above it. Starts from the bracket [lo, hi], halving ``lo`` until it
    holds (0.0 if it never does) and doubling ``hi`` until it fails."""
    if not 0 < lo < hi or rel_tol <= 0:
        raise ValueError(f"need 0 < lo < hi and rel_tol > 0, got {lo}, {hi}, {rel_tol}")
    if not ok(lo):
        for _ in range(max_doublings):
            lo, hi = lo / 2, lo
            if ok(lo):
                break
        else:
            return 0.0
    else:
        for _ in range(max_doublings):
            if not ok(hi):
                break
            lo, hi = hi, hi * 2
        else:
            return lo
    while hi / lo > 1 + rel_tol:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo

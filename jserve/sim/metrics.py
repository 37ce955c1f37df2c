"""Latency summaries of record files (simulated or live): TTFT and TPOT percentiles of short
and long requests, and how many long requests completed. Pure Python (no JAX)."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

LONG_PROMPT_TOKENS = 32_768  # prompts at least this long count as long requests


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile where ``inf`` stands for "never happened": a requested
    rank that touches an unfinished request is ``inf``, so a backlog is not averaged away.
    NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q / 100 * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi or math.isinf(xs[hi]):
        return xs[lo] if lo == hi else math.inf
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft(rec: dict) -> float:
    """Seconds from arrival to first token; inf if none came."""
    first = rec["first_token_s"]
    return math.inf if first is None else first - rec["arrival_s"]


def tpot(rec: dict) -> float | None:
    """Mean seconds per output token after the first, for finished requests with at least
    two tokens (None otherwise: a backlog shows in TTFT and completion instead)."""
    if rec["finish_s"] is None or rec["output_tokens"] < 2:
        return None
    return (rec["finish_s"] - rec["first_token_s"]) / (rec["output_tokens"] - 1)


def summarize(records: Iterable[dict], long_prompt_tokens: int = LONG_PROMPT_TOKENS) -> dict:
    recs = list(records)
    short = [r for r in recs if r["prompt_tokens"] < long_prompt_tokens]
    long = [r for r in recs if r["prompt_tokens"] >= long_prompt_tokens]
    out: dict = {"requests": len(recs), "short": len(short), "long": len(long),
                 "long_completed": sum(r["finish_s"] is not None for r in long)}
    for name, group in (("short", short), ("long", long)):
        ttfts = [ttft(r) for r in group]
        tpots = [t for t in map(tpot, group) if t is not None]
        for q in (50, 90):
            out[f"{name}_ttft_p{q}"] = percentile(ttfts, q)
            out[f"{name}_tpot_p{q}"] = percentile(tpots, q)
    return out


def format_summary(s: dict) -> str:
    def f(x: float) -> str:
        return "-" if math.isnan(x) else ("never" if math.isinf(x) else f"{x:.3f}s")

    return "\n".join([
        f"short ({s['short']}): TTFT P50 {f(s['short_ttft_p50'])} P90 {f(s['short_ttft_p90'])}"
        f"  TPOT P50 {f(s['short_tpot_p50'])} P90 {f(s['short_tpot_p90'])}",
        f"long ({s['long']}): TTFT P50 {f(s['long_ttft_p50'])} P90 {f(s['long_ttft_p90'])}"
        f"  TPOT P50 {f(s['long_tpot_p50'])} P90 {f(s['long_tpot_p90'])}"
        f"  completed {s['long_completed']}/{s['long']}"])

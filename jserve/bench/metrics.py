"""Latency metrics of a run's records, one function for live and simulated runs alike.

Per group (short and long requests, split by prompt length): TTFT, TPOT, TBT and end-to-end
latency at P50/P90/P99, normalized latency (end-to-end seconds per output token, as Orca and
vLLM report it), the TTFT deadline-miss rate and completions; over the whole run: goodput
(requests per second that finished meeting both their TTFT and TPOT SLOs). Pure Python, no JAX.

Unfinished requests are not dropped: a TTFT or end-to-end latency that never happened is
``inf``, so a backlog shows in the percentiles instead of being averaged away.

``serving_result`` gives vLLM ``bench serve``'s result keys instead, over finished requests as
vLLM defines them (``jserve bench serve``: ``jserve.bench.serve_bench``).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterable, Sequence

LONG_PROMPT_TOKENS = 32_768  # default split: prompts at least this long are long requests
QUANTILES = (50, 90, 99)
GROUPS = ("short", "long")


@dataclasses.dataclass(frozen=True)
class Slo:
    """A request's TTFT SLO is max(``ttft_s``, ``ttft_per_token_s`` x its prompt tokens), so
    long prompts get deadlines that grow with their prefill; TPOT SLO is ``tpot_s``."""

    ttft_s: float = 0.5
    ttft_per_token_s: float = 0.0
    tpot_s: float = 0.05

    def __post_init__(self) -> None:
        if not (self.ttft_s >= 0 and self.ttft_per_token_s >= 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be non-negative (tpot_s > 0): {self}")

    def ttft_deadline(self, prompt_tokens: int) -> float:
        return max(self.ttft_s, self.ttft_per_token_s * prompt_tokens)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile where ``inf`` stands for "never happened": a requested
    rank that touches an unfinished request is ``inf``. NaN for no values."""
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


def e2e(rec: dict) -> float:
    """Seconds from arrival to the last token; inf if the request did not finish."""
    return math.inf if rec["finish_s"] is None else rec["finish_s"] - rec["arrival_s"]


def tpot(rec: dict) -> float | None:
    """Mean seconds per output token after the first, for finished requests with at least
    two tokens (None otherwise: a backlog shows in TTFT and completion instead)."""
    if rec["finish_s"] is None or rec["output_tokens"] < 2:
        return None
    return (rec["finish_s"] - rec["first_token_s"]) / (rec["output_tokens"] - 1)


def tbt(rec: dict) -> list[float]:
    """Every gap between consecutive output tokens (needs ``token_times_s``; [] without)."""
    times = rec.get("token_times_s") or []
    return [b - a for a, b in zip(times, times[1:])]


def meets_slo(rec: dict, slo: Slo) -> bool:
    """Finished, first token within its TTFT SLO, mean TPOT within the TPOT SLO."""
    t = tpot(rec)
    return (rec["finish_s"] is not None and ttft(rec) <= slo.ttft_deadline(rec["prompt_tokens"])
            and (t is None or t <= slo.tpot_s))


def summarize(records: Iterable[dict], *, long_prompt_tokens: int = LONG_PROMPT_TOKENS,
              slo: Slo = Slo(), window_s: float | None = None) -> dict:
    """Flat dict: counts, ``{group}_{metric}_p{q}`` for group in short/long/all and metric in
    ttft/tpot/tbt/e2e, ``{group}_normalized_latency`` (mean), ``{group}_deadline_miss_rate``,
    ``{group}_completed``, ``goodput_rps`` and ``window_s``. The window defaults to first
    arrival -> last event; goodput counts requests meeting both SLOs per second of it."""
    recs = list(records)
    groups = {"short": [r for r in recs if r["prompt_tokens"] < long_prompt_tokens],
              "long": [r for r in recs if r["prompt_tokens"] >= long_prompt_tokens],
              "all": recs}
    if window_s is None:
        events = [t for r in recs for t in (r["first_token_s"], r["finish_s"]) if t is not None]
        window_s = (max(events) - min(r["arrival_s"] for r in recs)) if events else 0.0
    out: dict = {"requests": len(recs), "long_prompt_tokens": long_prompt_tokens,
                 "window_s": window_s,
                 "goodput_rps": (sum(meets_slo(r, slo) for r in recs) / window_s
                                 if window_s > 0 else math.nan)}
    if any("cached_tokens" in r for r in recs):  # the live engine's prefix cache
        prompt = sum(r["prompt_tokens"] for r in recs)
        out["prefix_hit_rate"] = (sum(r.get("cached_tokens", 0) for r in recs) / prompt
                                  if prompt else math.nan)
    for name, group in groups.items():
        out[name] = len(group)
        out[f"{name}_completed"] = sum(r["finish_s"] is not None for r in group)
        series = {"ttft": [ttft(r) for r in group], "e2e": [e2e(r) for r in group],
                  "tpot": [t for t in map(tpot, group) if t is not None],
                  "tbt": [g for r in group for g in tbt(r)]}
        for metric, values in series.items():
            for q in QUANTILES:
                out[f"{name}_{metric}_p{q}"] = percentile(values, q)
        normalized = [e2e(r) / r["output_tokens"] for r in group
                      if r["finish_s"] is not None and r["output_tokens"]]
        out[f"{name}_normalized_latency"] = (sum(normalized) / len(normalized) if normalized
                                             else math.nan)
        out[f"{name}_deadline_miss_rate"] = (
            sum(ttft(r) > slo.ttft_deadline(r["prompt_tokens"]) for r in group) / len(group)
            if group else math.nan)
    return out


def _s(x: float) -> str:
    return "-" if math.isnan(x) else ("never" if math.isinf(x) else f"{x:.3f}s")


def format_summary(s: dict) -> str:
    lines = []
    for g in GROUPS:
        if not s[g]:
            continue
        lines.append(
            f"{g} ({s[g]}, completed {s[f'{g}_completed']}): "
            + "  ".join(f"{m.upper()} P50 {_s(s[f'{g}_{m}_p50'])} P90 {_s(s[f'{g}_{m}_p90'])}"
                        f" P99 {_s(s[f'{g}_{m}_p99'])}" for m in ("ttft", "tpot", "tbt", "e2e"))
            + f"  deadline misses {s[f'{g}_deadline_miss_rate']:.0%}")
    lines.append(f"goodput {s['goodput_rps']:.3f} req/s over {s['window_s']:.1f}s; normalized "
                 f"latency {s['all_normalized_latency']:.4f} s/token"
                 + (f"; prefix cache hit rate {s['prefix_hit_rate']:.1%}"
                    if "prefix_hit_rate" in s else ""))
    return "\n".join(lines)


def ratio(baseline: float, value: float) -> float:
    """How many times lower ``value`` is than ``baseline`` (inf when the baseline never came
    and the value did; nan when neither did)."""
    if math.isinf(baseline):
        return math.nan if math.isinf(value) else math.inf
    return baseline / value if value > 0 else math.inf


# -- vLLM's ``bench serve`` figures ------------------------------------------------------------
SERVING_METRICS = ("ttft", "tpot", "itl", "e2el")


def _gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def serving_result(records: Sequence[dict], duration_s: float, *,
                   metrics: Sequence[str] = ("ttft", "tpot", "itl"),
                   percentiles: Sequence[float] = (99,)) -> dict:
    """vLLM ``bench serve``'s result keys from ``run_http``'s records, defined as vLLM does:
    over the requests that finished (``completed``; the others ``failed``), TTFT is send to
    first chunk, TPOT ``(last - first token) / (output tokens - 1)`` for requests of 2 tokens
    or more (the first token left out), ITL every gap between consecutive chunks, E2EL send to
    last chunk; throughputs are totals over ``duration_s``. Input tokens are the server's
    ``usage.prompt_tokens`` where it reported them, else the prompt's length. Per metric in
    ``metrics``: ``mean_/median_/std_{m}_ms`` (population std) and ``p{q}_{m}_ms`` per
    percentile (linear interpolation, numpy's default); an empty series gives 0, as vLLM's."""
    ok = [r for r in records if r["finish_s"] is not None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r.get("usage_prompt_tokens") or r["prompt_tokens"] for r in ok)
    res = {"duration": duration_s, "completed": len(ok), "failed": len(records) - len(ok),
           "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
           "request_throughput": len(ok) / duration_s, "request_goodput": None,
           "output_throughput": out_tokens / duration_s,
           "total_token_throughput": (in_tokens + out_tokens) / duration_s, **_peaks(ok)}
    series = {"ttft": [ttft(r) for r in ok], "e2el": [e2e(r) for r in ok],
              "tpot": [t for t in map(tpot, ok) if t is not None],
              "itl": [g for r in ok for g in _gaps(r.get("chunk_times_s") or
                                                   r["token_times_s"])]}
    for m in metrics:
        if m not in series:
            raise ValueError(f"unknown metric {m!r}: choose from {', '.join(SERVING_METRICS)}")
        xs = series[m] or [0.0]
        res[f"mean_{m}_ms"] = sum(xs) / len(xs) * 1e3
        res[f"median_{m}_ms"] = percentile(xs, 50) * 1e3
        res[f"std_{m}_ms"] = statistics.pstdev(xs) * 1e3
        for q in percentiles:
            res[f"p{int(q) if int(q) == q else q}_{m}_ms"] = percentile(xs, q) * 1e3
    return res


def _peaks(ok: Sequence[dict]) -> dict:
    """The most output tokens in one second (seconds counted from the first send) and the
    most requests in flight at once (each from its send to its last token)."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    start = min(r["arrival_s"] for r in ok)
    per_second: dict[int, int] = {}
    for r in ok:
        for t in r["token_times_s"]:
            per_second[int(t - start)] = per_second.get(int(t - start), 0) + 1
    events = sorted([(r["arrival_s"], 1) for r in ok] + [(r["finish_s"], -1) for r in ok])
    level = peak = 0
    for _, d in events:  # at a tie an end comes first: [send, finish) intervals
        level += d
        peak = max(peak, level)
    return {"max_output_tokens_per_s": float(max(per_second.values(), default=0)),
            "max_concurrent_requests": peak}

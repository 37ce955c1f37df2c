"""The prefix cache's host tier, measured (``scripts/bench_kv_tier.py``, docs/prefix_cache.md):

- ``documents``: the issue's scenario on the live engine. A device pool for about two
  documents; documents asked one after another, then earlier ones asked again, each repeat
  beside a fresh document of the same length: with the tier the repeat's pages come back
  from the host by copy, without it they are prefilled again.
- ``multi_turn``: a long-document trace (documents totalling several times the pool, each
  asked several times with short chats between), one request at a time, tier off and on.
- ``simulated``: the same kind of trace at paper scale in the simulator, whose host tier
  restores at a stated PCIe bandwidth.

Every live request runs alone (the next one is added when the last has finished), so a TTFT
is that request's own: its prefill, or its restore and the rest."""
from __future__ import annotations

import dataclasses
import random
import statistics
from typing import Sequence

from jserve.bench.metrics import percentile

PAGE = 16


def ask_in_turn(llm, prompts: Sequence[list[int]], max_tokens: int = 1) -> list[dict]:
    """Runs ``prompts`` one at a time (greedy); per prompt: TTFT (s), prompt tokens, tokens
    taken from the cache and of those restored from the host, prefill tokens computed."""
    from jserve import SamplingParams  # loads JAX: only once an engine runs

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng, rows = llm.engine, []
    for prompt in prompts:
        eng.add_request(prompt, params)
        done = None
        while eng.has_unfinished():
            done = next((o for o in eng.step() if o.finished), done)
        m = done.metrics
        rows.append(dict(ttft_s=m.first_token_time - m.arrival_time, prompt=len(prompt),
                         cached=m.cached_tokens, restored=m.restored_tokens,
                         computed=len(prompt) - m.cached_tokens))
    return rows


def document_prompts(num_docs: int, doc_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(doc_tokens)] for _ in range(num_docs)]


def documents(llm, doc_tokens: int = 1500, num_docs: int = 6, repeats: int = 3) -> dict:
    """The scenario: ``num_docs`` documents in turn, then ``repeats`` times an earlier
    document asked again followed by a fresh one of the same length. Returns the rows and
    the median TTFT of the repeats and of the fresh ones."""
    docs = document_prompts(num_docs + repeats, doc_tokens)
    order = docs[:num_docs]
    for i in range(repeats):
        order += [docs[i], docs[num_docs + i]]
    rows = ask_in_turn(llm, order)
    repeat, fresh = rows[num_docs::2], rows[num_docs + 1::2]
    return dict(rows=rows, repeat_ttft_s=statistics.median(r["ttft_s"] for r in repeat),
                fresh_ttft_s=statistics.median(r["ttft_s"] for r in fresh))


def multi_turn_trace(num_docs: int, doc_tokens: int, asks: int, shorts: int,
                     seed: int = 0) -> list[tuple[str, list[int]]]:
    """(kind, prompt): each document asked ``asks`` times (document + a short question),
    ``shorts`` short chats after each ask, documents interleaved at random."""
    rng = random.Random(seed)
    docs = document_prompts(num_docs, doc_tokens, seed)
    seen: set[int] = set()
    turns = [d for d in range(num_docs) for _ in range(asks)]
    rng.shuffle(turns)
    trace = []
    for d in turns:
        question = [rng.randrange(3, 256) for _ in range(rng.randrange(8, 40))]
        trace.append(("repeat" if d in seen else "first", docs[d] + question))
        seen.add(d)
        for _ in range(shorts):
            trace.append(("short", [rng.randrange(3, 256) for _ in range(rng.randrange(20, 120))]))
    return trace


def summarize_turns(trace, rows, host_tier) -> dict:
    """TTFT P50/P90 by kind, the hit rate per tier (prompt tokens found on the device, on
    the host) and the pages the host tier moved."""
    out = {}
    for kind in ("repeat", "short", "first"):
        ttft = [r["ttft_s"] for (k, _), r in zip(trace, rows) if k == kind]
        out[kind] = dict(n=len(ttft), p50_s=percentile(ttft, 50), p90_s=percentile(ttft, 90))
    prompt = sum(r["prompt"] for r in rows)
    restored = sum(r["restored"] for r in rows)
    out["device_hit_rate"] = (sum(r["cached"] for r in rows) - restored) / prompt
    out["host_hit_rate"] = restored / prompt
    if host_tier is not None:
        out["offloaded_pages"] = host_tier.offloaded_pages
        out["restored_pages"] = host_tier.restored_pages
        out["moved_bytes"] = (host_tier.offloaded_pages + host_tier.restored_pages) \
            * host_tier.page_bytes
        out["restore_seconds"] = host_tier.restore_seconds
        out["learned_gb_per_s"] = host_tier.rate.bytes_per_s / 1e9
    return out


@dataclasses.dataclass(frozen=True)
class SimTier:
    """The paper-scale run: documents of ``doc_tokens`` (a range), each asked ``asks``
    times ``gap_s`` apart, between short requests (50-800 prompt tokens); a device pool of
    ``device_tokens`` and a host tier of ``host_tokens`` restoring at ``pcie_gb_per_s`` per
    GPU."""

    docs: int = 8
    doc_tokens: tuple[int, int] = (100_000, 1_000_000)
    asks: int = 4
    gap_s: float = 60.0
    shorts: int = 200
    qps: float = 0.135
    device_tokens: int = 1_500_000
    host_tokens: int = 8_000_000
    pcie_gb_per_s: float = 25.0
    seed: int = 0


def simulated(s: SimTier, policy: str = "lars", modes: Sequence[str] = ("off", "on")) -> dict:
    """The simulator's lars on Llama-3 8B, 16 A100 (TP8 x SPP2), caching on, without the
    host tier ("off") and with it ("on"): repeat and short TTFT, hits per tier."""
    from jserve.sim.policies import SimConfig, run_with_scheduler
    from jserve.sim.trace import TraceRequest, poisson_arrivals

    rng = random.Random(s.seed)
    arrivals = poisson_arrivals(s.shorts, s.qps, s.seed)
    trace = [TraceRequest(f"s{i}", float(t), rng.randrange(50, 800), rng.randrange(20, 300))
             for i, t in enumerate(arrivals)]
    span = float(arrivals[-1])
    for d in range(s.docs):
        n, start = rng.randrange(*s.doc_tokens), rng.uniform(0, span * 0.6)
        for k in range(s.asks):
            q = rng.randrange(50, 200)
            trace.append(TraceRequest(f"d{d}-{k}", start + k * s.gap_s, n + q, 64,
                                      prefix_id=f"doc{d}", prefix_tokens=n))
    trace.sort(key=lambda t: t.arrival_s)
    out = {}
    for name in modes:
        host = s.host_tokens if name == "on" else 0
        cfg = SimConfig(tp=8, spp=2, prefix_caching=True, kv_cache_tokens=s.device_tokens,
                        host_tier_tokens=host,
                        host_gb_per_s=s.pcie_gb_per_s)
        records, sched = run_with_scheduler(trace, policy, cfg)
        out[name] = _sim_summary(records, sched)
    return out


def _sim_summary(records: list[dict], sched) -> dict:
    def ttft(r):
        return float("inf") if r["first_token_s"] is None else r["first_token_s"] - r[
            "arrival_s"]

    long = [r for r in records if r["request_id"].startswith("d")]
    short = [r for r in records if r["request_id"].startswith("s")]
    repeats = [r for r in long if not r["request_id"].endswith("-0")]
    prompt = max(sched.prefix_queried_tokens, 1)
    host = sched.prefix_host_hit_tokens
    return dict(short_ttft_p50_s=percentile([ttft(r) for r in short], 50),
                short_ttft_p90_s=percentile([ttft(r) for r in short], 90),
                repeat_ttft_p50_s=percentile([ttft(r) for r in repeats], 50),
                repeat_ttft_p90_s=percentile([ttft(r) for r in repeats], 90),
                long_done=sum(r["finish_s"] is not None for r in long), long=len(long),
                device_hit_rate=(sched.prefix_hit_tokens - host) / prompt,
                host_hit_rate=host / prompt)

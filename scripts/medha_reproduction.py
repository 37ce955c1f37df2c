"""Medha's figures on the simulator, against the LoongServe baseline (jserve.sim.loongserve) and
the vLLM-like baseline (``sarathi``: FCFS chunked prefill, 512-token chunks) on the same 16
A100s: writes docs/reproduction.md (tables beside the paper's numbers) and its PNGs.

    python scripts/medha_reproduction.py                 # ~10 min on 2 cores
    python scripts/medha_reproduction.py --quick         # 300 requests, for a look

1. Saturation QPS of each system in the time model (jserve.sim.capacity); the headline runs
   at 80% of the lowest, with two run lengths, plus the paper's 0.75 QPS (labelled when it is
   above saturation).
2. 1M-token prefill time against SPP degree; 3. decode TPOT at long context against KVP
   degree (Llama-3 70B, H100, TP8, from the time model); 4. goodput at fixed SLOs;
5. the time model's error against held-out rows of the Vidur per-op profiles.
Long requests are synthetic (Medha-SWE is not public): log-normal on its published P50/P90.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import re
import statistics
import textwrap
import time
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from jserve.bench.metrics import (  # noqa: E402
    LONG_PROMPT_TOKENS as LONG,  # noqa: E402
    Slo,
    summarize,
    ttft,
)
from jserve.bench.workload import WorkloadSpec, build_workload  # noqa: E402
from jserve.data import profiles_root  # noqa: E402
from jserve.scheduler.chunking import PrefillTimeCache  # noqa: E402
from jserve.scheduler.plan import BatchPlan, ScheduledChunk  # noqa: E402
from jserve.sim.hardware import (  # noqa: E402
    LAYER_OPS,
    GpuTimeModel,
    StageTimes,
    _Curve,
    _load_compute,
)
from jserve.sim.policies import (  # noqa: E402
    SimConfig,
    default_ttft_deadlines,
    isolated_ttfts,
    run,
    saturation,
)

MESH = SimConfig(model="llama3-8b", hardware="a100", tp=8, spp=2)
SYSTEMS = ("lars", "loongserve", "sarathi")
PAPER_QPS = 0.75
SLO = Slo(ttft_s=2.0, ttft_per_token_s=2e-4, tpot_s=0.1)  # 2 s, or 200 s for 1M tokens
# Medha vs LoongServe at 0.75 QPS: 30x P50; 174x "P99" (abstract) or "P90" (§6.4).
PAPER = {50: "30x", 90: "174x (§6.4)", 99: "174x (abstract)"}


BASELINES = """## The baselines

**LoongServe** (`jserve/scheduler/loongserve.py`, run by `jserve/sim/loongserve.py`, costs in
`jserve/sim/esp.py`): eight TP-2 elastic instances on the same 16 GPUs, one unified KV pool at
token granularity. Every rule, with the LoongServe paper's section:

| rule | section | simplified here |
|---|---|---|
| pending queue scanned FCFS; a request joins only if the unused KV slots of the instances hold its prompt + maximum output (no future eviction) | §5.1 | - |
| stop adding prefills once the batch's predicted time passes the memory-to-compute tipping point | §5.1 | tipping point from the time model (the 512-token-prompt batch within 10% of compute-bound per-token time), not profiled |
| a later request may take a decode instance when eq. (2) gain > eq. (1) cost | §5.1 | one instance per decision |
| the head request takes decode instances with the most unused slots when idle ones lack memory; their KV is migrated to other instances | §5.2 | migration at the `send_recv` profile's time; KV that cannot move stays and its decodes stall |
| scale-up: add the instance with the fewest used slots while eq. (3) latency gain > eq. (4) migration cost | §5.2 | - |
| batching: DP of eq. (5) over length-sorted requests and (node, unused slots)-sorted instances | §5.3 | O(n^2 m^2) DP without the quadrangle-inequality speed-up |
| scale-down after prefill to the fewest instances that hold the KV; proactive migration overlaps the KV transfer with the prefill | §4.1, §5.4 | transfer timed by `send_recv`; only the part longer than the prefill delays the first decode |
| multi-master decoding: a request's decode attention runs where its KV lies | §4.2 | decode instances step in lock-step rounds (LoongServe's batches are asynchronous); the batch-size scale-up of §5.4 is not modelled |
| prefill time on d instances: striped attention splits tokens and causal attention evenly | §2.3 | ring KV passes taken as hidden under attention (favours LoongServe) |

**vLLM-like** (`sarathi`): vLLM's scheduler for long contexts is Sarathi-Serve (Medha §6.1):
decodes first, then FCFS prefill chunks of 512 tokens, on the same TP8 x SPP2 mesh as lars.
"""  # noqa: E501  (a markdown table: one row a line)

def reflow(text: str, width: int = 96) -> str:
    """Markdown paragraphs and "- " bullets refilled (f-string values break the wrapping)."""
    out = []
    for block in text.strip().split("\n\n"):
        items = re.split(r"\n(?=- )", block)
        for item in items:
            words = " ".join(item.split())
            bullet = words.startswith("- ")
            out.append(textwrap.fill(words, width, subsequent_indent="  " if bullet else "",
                                     break_on_hyphens=False))
        out.append("")
    return "\n".join(out)


def summary(lars: dict, fast: dict, by: dict) -> str:
    """The targets in one sentence each: which are met, which missed and by how much."""
    met, missed = [], []
    for q, goal in ((50, 30), (90, 100), (99, 174)):
        for b in ("loongserve", "sarathi"):
            x = by[b][f"short_ttft_p{q}"] / lars[f"short_ttft_p{q}"]
            (met if x >= goal else missed).append(
                f"P{q} short TTFT vs {b} {x:.1f}x" + ("" if x >= goal else
                                                       f" (target {goal}x, {goal / x:.0f}x short)"))
    for b in ("loongserve", "sarathi"):
        for q in (50, 90):
            key = f"short_tpot_p{q}"
            item = f"TPOT P{q} vs {b} ({lars[key] * 1e3:.1f} / {by[b][key] * 1e3:.1f} ms"
            if lars[key] <= by[b][key]:
                met.append(item + ")")
            else:
                ok = fast[key] <= by[b][key]
                missed.append(item + f", {lars[key] / by[b][key]:.1f}x; at t_target 25 ms "
                              f"{fast[key] * 1e3:.1f} ms, {'met' if ok else 'still missed'})")
    (met if lars["long_completed"] == lars["long"] else missed).append(
        f"every long request completed ({lars['long_completed']}/{lars['long']})")
    return f"met: {'; '.join(met)}. Missed: {'; '.join(missed) or 'none'}."


def why(by: dict, sat: dict, qps: float, paper: dict, half: dict, floor: float) -> str:
    """Where the paper's numbers are not reached, with this run's figures (``by``: the
    headline run's systems and lars variants; ``half``: the shorter run's systems;
    ``floor``: the median short request's isolated TTFT on lars's mesh)."""
    lars, loong, fast = by["lars"], by["loongserve"], by["lars, t_target 25 ms"]
    before = by[BEFORE]
    tail = [loong[f"short_ttft_p{q}"] / lars[f"short_ttft_p{q}"] >= goal
            for q, goal in ((90, 100), (99, 174))]
    met_tail = ("met" if all(tail) else "missed" if not any(tail) else
                "P90 " + ("met" if tail[0] else "missed") + ", P99 "
                + ("met" if tail[1] else "missed"))

    def vs(a: dict, b: dict, q: int) -> str:
        return ratio(a[f"short_ttft_p{q}"], b[f"short_ttft_p{q}"])
    return "## Where the paper's numbers are not reached, and why\n\n" + reflow(f"""

- **lars vs LoongServe, short-request TTFT P50** (paper 30x; here
  {ratio(loong["short_ttft_p50"], lars["short_ttft_p50"])}: {loong["short_ttft_p50"]:.3f} s
  against lars's {lars["short_ttft_p50"]:.3f} s). The faithful LoongServe's rules leave most
  instances idle most of the time: a long prefill takes only the instances that are idle
  when it is dispatched (or all of them when the cluster is quiet), and a short prompt
  arriving next finds an idle TP-2 instance and prefills at once in ~20-40 ms. LoongServe
  convoys only when a long prefill holds every instance, which hits a minority of short
  requests: it shows in the P90/P99, not the median. The paper's LARS (Medha §4.1) lets a
  short request wait while its relative slack exceeds the running long prefill's, so its
  shorts finish late in their 0.5 s deadline (lars without quick first:
  {by[NO_QUICK]["short_ttft_p50"]:.3f} s, {ratio(loong["short_ttft_p50"],
  by[NO_QUICK]["short_ttft_p50"])} against LoongServe). jserve's lars serves a request whose
  whole remaining prefill fits in 4 iterations' budget at once (`DeadlineConfig.quick_first`,
  next section), which brings its median near the floor below. The paper's 30x median needs
  LoongServe to convoy most short requests, which happens here only above saturation (0.75
  QPS rows: LoongServe's median {paper["loongserve"]["short_ttft_p50"]:.1f} s) or with a
  LoongServe that gives every long prefill all instances (the previous baseline of this
  repository did, and was 428x worse than lars). Not tuned away: a baseline that loses on
  purpose is not the point.
- **The floor under that median.** Alone on TP8 x SPP2 the median short request's first
  token takes {floor * 1e3:.0f} ms (its isolated prefill in lars's chunks plus the
  pipeline's last pass, `jserve.sim.policies.isolated_ttfts`). No order brings lars's P50
  below it, so against this LoongServe's {loong["short_ttft_p50"]:.2f} s the P50 ratio
  cannot exceed {loong["short_ttft_p50"] / floor:.1f}x: the paper's 30x is out of reach on
  this mesh and workload whatever the policy; lars's own P50 is
  {lars["short_ttft_p50"] / floor:.1f}x its floor.
- **P90/P99 vs LoongServe** are {met_tail} in the {lars["n"]}-request run
  ({vs(loong, lars, 90)} / {vs(loong, lars, 99)}; lars keeps its shorts within their deadline,
  {lars["short_attainment"]:.1%} within 0.5 s; before the attainment fix below its P90 was
  {before["short_ttft_p90"]:.2f} s and these ratios {vs(loong, before, 90)} /
  {vs(loong, before, 99)}). They depend on the run: in the {half["lars"]["n"]}-request run
  they are {vs(half["loongserve"], half["lars"], 90)} /
  {vs(half["loongserve"], half["lars"], 99)}. LoongServe's tail is short requests behind an
  all-instance 1M prefill, which wait minutes; how many there are is a property of the
  sample, not of lars.
- **TPOT P50** at lars's default budget is missed by the factor in the targets table, by
  design (next section): the t_target = 25 ms row {"meets" if fast["short_tpot_p50"] <= min(
  loong["short_tpot_p50"], by["sarathi"]["short_tpot_p50"]) else "does not meet"} it
  against both baselines ({fast["short_tpot_p50"] * 1e3:.1f} ms P50 against
  {loong["short_tpot_p50"] * 1e3:.1f} / {by["sarathi"]["short_tpot_p50"] * 1e3:.1f} ms;
  its TTFT ratios are in the targets table), at the price of prefill capacity (saturation
  {sat["lars, t_target 25 ms"]:.3f} QPS against {sat["lars"]:.3f}; the headline load is then
  {qps / sat["lars, t_target 25 ms"]:.0%} of its saturation). The paper measured 5x higher
  LoongServe TPOT, from fragmentation this model does not have (token-granular KV pool,
  perfectly balanced multi-master decoding).
- **At the paper's 0.75 QPS** (above saturation in this time model) LoongServe convoys at the
  median too: lars's advantage is of the paper's order or beyond at P50 and P90, but it grows
  with run length there, so it is not a steady-state figure.
- **vs vLLM-like (sarathi).** Every short request that arrives behind a long prompt's 512-token
  chunks waits for the whole long prefill (FCFS), so the convoy shows at P50 as well as the
  tail: those targets are met.
- **Long requests' own deadlines** (1.5 x isolated prefill): lars meets
  {lars["long_attainment"]:.0%} of them at 80% of saturation. A long prefill's mean isolated
  time is ~30 s and one arrives every ~40 s, so long prefills queue behind each other and
  1.5x is rarely reachable under any order; every long request completes.
- **The live engine** (CPU, tiny model): the convoy benchmark over 3 seeds and 2 loads, with
  lars's deadline attainment there and why it is lower than here, is in docs/convoy.md ("Over
  seeds and loads").
- **Workload caveat.** Medha-SWE is not public: the long requests are a log-normal fitted to
  its published P50/P90. The saturation QPS depends on the sample (5% of 1000 requests is 50
  long prompts; their mean prefill dominates the work).
""")


ATTAINMENT = """Before this change lars met the short requests' 0.5 s TTFT deadline only about
half the time. Two causes, each fixed (`docs/scheduler.md`, "Due requests and the pipeline's last
pass"): (1) a late long prefill's key (negative slack over its remaining work) ranked it
before every short request with slack left, so they had to become late before they ran: now a
request with less than one iteration (t_target) of slack left is *due* and due requests go
first, least remaining work first, while late ones keep the paper's order after them;
(2) the slack left out the pipeline's last pass (the first token leaves one pipeline latency
after the last chunk's issue, ~23 ms more than the stage times the isolated prefill sums), and
LARS leaves a short request only a few ms of slack when it starts it. Each alone is not
enough; together they take attainment to ~99% at both loads without moving TPOT or the long
requests' TTFT. A third rule, *quick first* (`DeadlineConfig.quick_first`, 4 by default),
ranks a request with the due ones as soon as its whole remaining prefill fits in 4 x t_target
of work, however much slack it has: short prompts are served at once rather than near their
deadline. The work is the same, only its order changes, so the long requests' TTFT and the
TPOT do not move while the short requests' median and tail fall to near their isolated
prefill time."""

TPOT = """lars fills every iteration to its budget t_target, which the deadline policies take from
the TPOT SLO (50 ms; Medha §4.3: the budget is "derived from decode requests' TPOT SLOs").
At this load a long prefill is pending almost all the time, so each iteration is the decodes
plus that prefill's adaptive chunk up to ~50 ms of pipeline latency, and a decode's next
token comes one latency later: lars's short TPOT P50 is its budget. That is the policy
spending the SLO on prefill, not a defect (the decodes meet the SLO; P90 stays near it, where
both baselines' P90 is higher). sarathi's fixed 512-token chunks and LoongServe's decode-only
TP-2 instances run shorter iterations at short context, hence their lower medians. The budget
is a knob; halving it trades prefill capacity for TPOT:"""


def workload(n: int, qps: float, seed: int):
    return build_workload(WorkloadSpec(num_requests=n, long_fraction=0.05, qps=qps, seed=seed))


# lars variants (label -> SimConfig fields): the TTFT-deadline attainment before and after
# the pipeline drain in the slack and the due-first order (jserve.scheduler.deadline), and a
# smaller iteration budget (TPOT).
BEFORE = "lars (paper order, no drain)"
NO_QUICK = "lars (drain + due first, no quick first)"
VARIANTS = {BEFORE: dict(due_first=False, pipeline_drain=False),
            "lars (+ drain only)": dict(due_first=False, quick_first=0.0),
            "lars (+ due first only)": dict(pipeline_drain=False, quick_first=0.0),
            NO_QUICK: dict(quick_first=0.0),
            "lars, t_target 25 ms": dict(tpot_slo=0.025)}


def run_one(args: tuple[str, int, float, int]) -> dict:
    label, n, qps, seed = args
    policy = "lars" if label in VARIANTS else label
    trace = workload(n, qps, seed)
    t0 = time.perf_counter()
    records = run(trace, policy, dataclasses.replace(MESH, **VARIANTS.get(label, {})))
    s = summarize(records, slo=SLO)
    # Deadlines: the deadline policies' defaults on MESH, the same for every system.
    met = {"short": [], "long": []}
    for r, due in zip(records, default_ttft_deadlines(trace, MESH)):
        met["long" if r["prompt_tokens"] >= LONG else "short"].append(
            r["first_token_s"] is not None and r["first_token_s"] - r["arrival_s"] <= due)
    long_ttft = [ttft(r) for r in records if r["prompt_tokens"] >= LONG]
    return {"policy": label, "n": n, "qps": qps, "wall_s": time.perf_counter() - t0, **s,
            "short_attainment": sum(met["short"]) / len(met["short"]),
            "long_attainment": sum(met["long"]) / len(met["long"]),
            "long_ttft_max": max(long_ttft)}


def fmt(x: float, digits: int = 2) -> str:
    return "never" if math.isinf(x) else ("-" if math.isnan(x) else f"{x:.{digits}f}")


def ratio(base: float, lars: float) -> str:
    if math.isinf(base):
        return "inf"
    return f"{base / lars:.1f}x" if lars > 0 else "-"


def comparison_table(rows: list[dict]) -> list[str]:
    out = ["| load | requests | system | short TTFT P50 (s) | P90 | P99 | short TPOT P50 (s) "
           "| P90 | short within deadline | long TTFT P50 (s) | long completed "
           "| goodput (req/s) | lars's P50 / P90 / P99 advantage |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lars = next(x for x in rows if x["policy"] == "lars" and x["n"] == r["n"]
                    and x["qps"] == r["qps"])
        adv = " / ".join(ratio(r[f"short_ttft_p{q}"], lars[f"short_ttft_p{q}"])
                         for q in (50, 90, 99)) if r["policy"] != "lars" else ""
        out.append(f"| {r['label']} | {r['n']} | {r['policy']} | " + " | ".join(
            fmt(r[k]) for k in ("short_ttft_p50", "short_ttft_p90", "short_ttft_p99")) + " | "
            + " | ".join(fmt(r[k], 3) for k in ("short_tpot_p50", "short_tpot_p90"))
            + f" | {r['short_attainment']:.1%}"
            + f" | {fmt(r['long_ttft_p50'], 1)} | {r['long_completed']}/{r['long']} "
            f"| {r['goodput_rps']:.3f} | {adv} |")
    return out



def ttft_target_rows(me: dict, by: dict, label: str) -> list[str]:
    """The short-TTFT target rows (P50/P90/P99 ratios of each baseline to ``me``)."""
    rows = []
    for q, goal in ((50, 30), (90, 100), (99, 174)):
        cells = [by[b][f"short_ttft_p{q}"] / me[f"short_ttft_p{q}"] for b in
                 ("loongserve", "sarathi")]
        rows.append(f"| short TTFT P{q} >= {goal}x{label} | {PAPER[q]} | "
                    + " | ".join(f"{c:.1f}x ({'met' if c >= goal else 'MISSED'})"
                                 for c in cells) + " |")
    return rows

def attainment_table(rows: list[dict]) -> list[str]:
    """lars before / after the two changes: TTFT-deadline attainment, TTFT, TPOT, longs."""
    out = ["| load | lars | short within deadline (0.5 s) | long within deadline | short TTFT "
           "P50 / P90 / P99 (s) | short TPOT P50 / P90 (ms) | long TTFT P50 / P90 / max (s) "
           "| long completed |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "now (drain + due first + quick first)" if r["policy"] == "lars" else r["policy"]
        out.append(
            f"| {r['qps']} QPS | {name} | {r['short_attainment']:.1%} | "
            f"{r['long_attainment']:.0%} | "
            + " / ".join(fmt(r[f"short_ttft_p{q}"], 3) for q in (50, 90, 99)) + " | "
            + " / ".join(f"{r[f'short_tpot_p{q}'] * 1e3:.1f}" for q in (50, 90)) + " | "
            + " / ".join(fmt(r[k], 0) for k in ("long_ttft_p50", "long_ttft_p90",
                                                 "long_ttft_max"))
            + f" | {r['long_completed']}/{r['long']} |")
    return out


def tpot_table(rows: list[dict]) -> list[str]:
    """lars at its default 50 ms budget and at 25 ms against the baselines, same load."""
    by = {r["policy"]: r for r in rows}
    out = ["| system | short TPOT P50 / P90 (ms) | short TTFT P50 / P90 / P99 (s) "
           "| short within deadline | long TTFT P50 (s) | long completed "
           "| vs loongserve P50 / P90 / P99 | vs sarathi P50 / P90 / P99 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("lars", "lars, t_target 25 ms", "loongserve", "sarathi"):
        r = by[name]
        vs = [" / ".join(ratio(by[b][f"short_ttft_p{q}"], r[f"short_ttft_p{q}"])
                         for q in (50, 90, 99)) if name.startswith("lars") else ""
              for b in ("loongserve", "sarathi")]
        out.append(f"| {'lars, t_target 50 ms' if name == 'lars' else name} | "
                   + " / ".join(f"{r[f'short_tpot_p{q}'] * 1e3:.1f}" for q in (50, 90)) + " | "
                   + " / ".join(fmt(r[f"short_ttft_p{q}"], 3) for q in (50, 90, 99))
                   + f" | {r['short_attainment']:.1%} | {fmt(r['long_ttft_p50'], 1)} | "
                   f"{r['long_completed']}/{r['long']} | {vs[0]} | {vs[1]} |")
    return out


def spp_scaling(out_dir: Path) -> list[str]:
    """1M-token isolated prefill (Llama-3 70B, H100, TP8) against SPP degree."""
    rows, base = [], None
    for spp in (1, 2, 4, 8):
        model = GpuTimeModel("llama3-70b", "h100", tp=8, spp=spp)
        # Chunks sized to a 4 s stage budget (long chunks: SPP's prefill-throughput regime).
        t = PrefillTimeCache(StageTimes(model), 1 << 20, 4.0, max_chunk=32_768).time(1 << 20)
        base = base or t
        rows.append((spp, 8 * spp, t, base / t, base / t / spp))
    plt.figure(figsize=(4.5, 3.2))
    plt.plot([r[0] for r in rows], [r[3] for r in rows], "o-", label="simulated")
    plt.plot([1, 8], [1, 8], "k--", lw=0.8, label="linear")
    plt.xlabel("SPP degree (TP8 each)")
    plt.ylabel("1M-token prefill speed-up")
    plt.legend()
    plt.tight_layout()
    plt.savefig(out_dir / "spp_scaling.png", dpi=120)
    plt.close()
    return ["| SPP | GPUs | 1M prefill (s) | speed-up | efficiency |", "|---:|---:|---:|---:|---:|"
            ] + [f"| {a} | {b} | {c:.1f} | {d:.2f}x | {e:.0%} |" for a, b, c, d, e in rows]


def kvp_tpot(out_dir: Path) -> list[str]:
    """Decode iteration (TPOT) of one 2M-token request beside 32 short decodes, against KVP."""
    rows = []
    for kvp in (1, 2, 4):
        model = GpuTimeModel("llama3-70b", "h100", tp=8, spp=1, kvp=kvp)
        for ctx in (1 << 20, 2 << 20):
            plan = BatchPlan((ScheduledChunk("long", ctx, 1, True),) + tuple(
                ScheduledChunk(f"s{i}", 2000, 1, True) for i in range(32)), ())
            rows.append((kvp, ctx, model.predict(plan)))
    plt.figure(figsize=(4.5, 3.2))
    for ctx in (1 << 20, 2 << 20):
        pts = [(k, t) for k, c, t in rows if c == ctx]
        plt.plot(*zip(*pts), "o-", label=f"{ctx >> 20}M context")
    plt.xlabel("KVP degree (TP8 each)")
    plt.ylabel("TPOT (s)")
    plt.legend()
    plt.tight_layout()
    plt.savefig(out_dir / "kvp_tpot.png", dpi=120)
    plt.close()
    one = {c: t for k, c, t in rows if k == 1}
    return ["| KVP | GPUs | context | TPOT (ms) | vs KVP 1 |", "|---:|---:|---:|---:|---:|"] + [
        f"| {k} | {8 * k} | {c >> 20}M | {t * 1e3:.1f} | {one[c] / t:.2f}x |" for k, c, t in rows]


def profile_error() -> list[str]:
    """The time model's per-layer curve fitted on alternate token counts of each Vidur
    ``mlp.csv``, its relative error on the held-out ones (the model's own interpolation)."""
    out = ["| profile | TP | held-out rows | median error | P90 error |",
           "|---|---:|---:|---:|---:|"]
    for path in sorted((profiles_root() / "profiles" / "compute").glob("*/*/mlp.csv")):
        prof = _load_compute(path)
        for tp, ops in sorted(prof.medians_ms.items()):
            sizes = sorted(ops["add"])
            total = {n: sum(statistics.mean(ops[op][n]) for op in LAYER_OPS) for n in sizes}
            fit, held = sizes[::2], sizes[1::2]
            curve = _Curve.from_points({n: [total[n]] for n in fit})
            err = [abs(curve(n) - total[n]) / total[n] for n in held if n < fit[-1]]
            out.append(f"| {path.parent.parent.name}/{path.parent.name} | {tp} | {len(err)} | "
                       f"{np.median(err):.1%} | {np.percentile(err, 90):.1%} |")
    return out


def bars(rows: list[dict], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, (key, label) in zip(axes, (("short_ttft_p50", "short TTFT P50 (s)"),
                                       ("short_ttft_p99", "short TTFT P99 (s)"),
                                       ("short_tpot_p50", "short TPOT P50 (s)"))):
        vals = [r[key] if math.isfinite(r[key]) else np.nan for r in rows]
        ax.bar([r["policy"] for r in rows], vals, color=["C0", "C1", "C2"][:len(rows)])
        ax.set_yscale("log")
        ax.set_title(label)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ablation_order(r: dict) -> tuple:
    names = [BEFORE, "lars (+ drain only)", "lars (+ due first only)", NO_QUICK, "lars"]
    return r["qps"], names.index(r["policy"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=Path("docs"))
    ap.add_argument("--attainment-only", action="store_true",
                    help="only lars's TTFT-deadline attainment before / after (~1 min); "
                         "prints its table, writes nothing")
    a = ap.parse_args()
    figs = a.out_dir / "reproduction"
    long_n = 300 if a.quick else 1000
    lengths = workload(long_n, 1.0, a.seed)
    sat = {p: saturation(lengths, p, MESH) for p in SYSTEMS}
    lowest = min(sat.values())
    qps = round(0.8 * lowest, 3)
    sat["lars, t_target 25 ms"] = saturation(lengths, "lars", dataclasses.replace(
        MESH, **VARIANTS["lars, t_target 25 ms"]))
    ablation = [(v, long_n, qps, a.seed) for v in VARIANTS if v != "lars, t_target 25 ms"]
    ablation += [(BEFORE, long_n, PAPER_QPS, a.seed)]
    if a.attainment_only:
        tasks = ablation + [("lars", long_n, q, a.seed) for q in (qps, PAPER_QPS)]
        with multiprocessing.Pool(a.jobs) as pool:
            rows = pool.map(run_one, tasks, chunksize=1)
        print(f"{long_n} requests, seed {a.seed}; {qps} QPS is 80% of saturation")
        print("\n".join(attainment_table(sorted(rows, key=_ablation_order))))
        return
    figs.mkdir(parents=True, exist_ok=True)
    tasks = [(p, n, qps, a.seed) for n in (long_n, long_n // 2) for p in SYSTEMS]
    tasks += [(p, long_n, PAPER_QPS, a.seed) for p in SYSTEMS]
    tasks += ablation + [("lars, t_target 25 ms", long_n, qps, a.seed)]
    t0 = time.perf_counter()
    with multiprocessing.Pool(a.jobs) as pool:
        every = pool.map(run_one, tasks, chunksize=1)
    rows = sorted((r for r in every if r["policy"] in SYSTEMS), key=lambda r: (
        r["qps"] != qps, r["n"], SYSTEMS.index(r["policy"])))
    variants = [r for r in every if r["policy"] not in SYSTEMS]
    for r in rows:
        r["label"] = (f"{r['qps']} QPS (80% of saturation)" if r["qps"] == qps else
                      f"{r['qps']} QPS ({'ABOVE' if r['qps'] > lowest else 'below'}"
                      f" saturation; the paper's load)")
    head = [r for r in rows if r["qps"] == qps and r["n"] == long_n]
    bars(head, figs / "headline.png", f"{long_n} requests at {qps} QPS (80% of saturation)")
    bars([r for r in rows if r["qps"] == PAPER_QPS], figs / "paper_load.png",
         f"{long_n} requests at {PAPER_QPS} QPS")
    by = {r["policy"]: r for r in head}
    lars = by["lars"]
    lines = ["# Medha's figures on the simulator", "",
             f"Generated by `python scripts/medha_reproduction.py{' --quick' if a.quick else ''}`"
             f" ({time.perf_counter() - t0:.0f} s of runs). Llama-3 8B, 16 A100s: lars and the "
             "vLLM-like `sarathi` on TP8 x SPP2, LoongServe on eight TP-2 elastic instances "
             "(Medha §6.2). Workload: ShareGPT4 shorts + 5% synthetic Medha-SWE long requests "
             f"(128K-1M tokens), Poisson arrivals, seed {a.seed}. Goodput: requests per second "
             f"meeting TTFT <= max({SLO.ttft_s} s, {SLO.ttft_per_token_s * 1e3:.1f} ms x prompt "
             f"tokens) and TPOT <= {SLO.tpot_s} s. Every run goes on until every request "
             "finishes.", "", "## Saturation QPS (time model)", "",
             "| system | saturation QPS |", "|---|---:|"]
    lines += [f"| {p} | {v:.3f} |" for p, v in sat.items()]
    lines += ["", f"Headline load: 80% of the lowest of the three systems, **{qps} QPS**. The "
              f"paper's 0.75 QPS is {'above' if PAPER_QPS > lowest else 'below'} saturation "
              "here.", "",
              BASELINES, "## Short-request TTFT and TPOT (Medha Figs. 1a, 9b, 10)", "",
              "![headline](reproduction/headline.png) ![paper load](reproduction/paper_load.png)",
              ""]
    lines += comparison_table(rows)
    lines += ["", "### Targets (80% of saturation, the longer run)", "",
              "| target | paper | lars vs loongserve | lars vs sarathi (vLLM-like) |",
              "|---|---:|---:|---:|"]
    lines += ttft_target_rows(lars, by, "")
    lines.append("| every long request completed (lars) | - | "
                 f"{lars['long_completed']}/{lars['long']} | same run |")
    fast = next(r for r in variants if r["policy"] == "lars, t_target 25 ms")
    for who, me in (("lars", lars), ("lars at t_target 25 ms", fast)):
        for q in (50, 90):
            key = f"short_tpot_p{q}"
            lines.append(f"| short TPOT P{q} no worse ({who} / baseline) | - | " + " | ".join(
                f"{me[key] * 1e3:.1f} / {by[b][key] * 1e3:.1f} ms "
                f"({'met' if me[key] <= by[b][key] else 'MISSED'})"
                for b in ("loongserve", "sarathi")) + " |")
    lines += ttft_target_rows(fast, by, ", lars at t_target 25 ms")
    lines.append(f"| TTFT-deadline attainment, short requests (lars) | - | "
                 f"{lars['short_attainment']:.1%} | same run |")
    lines += ["", "**In short**, " + summary(lars, fast, by)]
    lines += ["", "### lars's TTFT-deadline attainment, before and after", "",
              reflow(ATTAINMENT),
              f"`python scripts/medha_reproduction.py --attainment-only` prints this table "
              f"alone ({long_n} requests, seed {a.seed}; deadlines: the deadline policies' "
              "default, max(1.5 x isolated prefill, 0.5 s), the same for every row):", ""]
    lines += attainment_table(sorted(
        [r for r in variants if r["policy"] != "lars, t_target 25 ms"]
        + [r for r in rows if r["policy"] == "lars" and r["n"] == long_n],
        key=_ablation_order))
    lines += ["", "### TPOT: lars's iteration budget", "", reflow(TPOT),
              f"{long_n} requests at {qps} QPS:", ""]
    lines += tpot_table(head + [r for r in variants if r["policy"] == "lars, t_target 25 ms"])
    trace = workload(long_n, qps, a.seed)
    floor = statistics.median(t for r, t in zip(trace, isolated_ttfts(trace, MESH))
                              if r.prompt_tokens < LONG)
    lines += ["", why({**by, **{r["policy"]: r for r in variants if r["qps"] == qps}}, sat, qps,
                      {r["policy"]: r for r in rows if r["qps"] == PAPER_QPS},
                      {r["policy"]: r for r in rows if r["qps"] == qps and r["n"] != long_n},
                      floor),
              "## 1M-token prefill time against SPP degree (Medha Fig. 11 / §4)", "",
              "Llama-3 70B, H100, TP8 per stage, isolated prefill with 32K-token chunks.", "",
              "![spp](reproduction/spp_scaling.png)", ""] + spp_scaling(figs)
    lines += ["", "## Decode TPOT at long context against KVP degree (Medha Fig. 12)", "",
              "Llama-3 70B, H100, TP8 per KV group; one long decode beside 32 short ones.", "",
              "![kvp](reproduction/kvp_tpot.png)", ""] + kvp_tpot(figs)
    lines += ["", "## The time model against the Vidur profiles (held-out rows)", "",
              "Per-layer non-attention time (the ops of `mlp.csv`), curve built from every "
              "other profiled token count, error on the others:", ""] + profile_error()
    (a.out_dir / "reproduction.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

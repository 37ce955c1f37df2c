"""The Medha reproduction page (docs/reproduction.md): the runs of ``harness.medha``
written out as tables beside the paper's numbers, with the hand-written model description of
the baselines and a section marked commentary; every other sentence with a number comes from
the run."""
from __future__ import annotations

from pathlib import Path

from harness.medha import (
    GOODPUT,
    GOODPUT_TOL,
    LONG,
    POLICIES,
    SLO,
    VARIANTS,
    Load,
    Runs,
    ablation_order,
    kvp_tpot,
    profile_error,
    run_all,
    short_floors,
    spp_scaling,
)
from harness.medha_tables import (
    attainment_table,
    comparison_table,
    fmt,
    goodput_table,
    own_load_table,
    reflow,
    targets_table,
)

BASELINES = """## The baselines (model description, hand-written)

**LoongServe** (`jserve/sim/loongserve_manager.py`, run by `jserve/sim/loongserve.py`, costs
in `jserve/sim/esp.py`): eight TP-2 elastic instances on the same 16 GPUs, one unified KV
pool at token granularity. Every instance keeps its own clock: a decode group (the instances
sharing decoding requests' KV) iterates as soon as its previous iteration ends, and an idle
instance starts a prefill the moment it is dispatched. Every rule, with the LoongServe
paper's section, and what is still simplified with the direction it biases the comparison:

| rule | section | simplified here (bias) |
|---|---|---|
| pending queue scanned FCFS; a request joins only if the unused KV slots of the instances hold its prompt + maximum output (no future eviction) | §5.1 | - |
| stop adding prefills once the batch's predicted time passes the memory-to-compute tipping point | §5.1 | tipping point from the time model (the 512-token-prompt batch within 10% of compute-bound per-token time), not profiled (either way) |
| a later request may take a decode instance when eq. (2) gain > eq. (1) cost | §5.1 | one instance per decision, the first whose slots fit (against LoongServe: fewer prefill instances) |
| the head request takes decode instances with the most unused slots when idle ones lack memory; their KV is migrated to other instances | §5.2 | the prefill starts when those instances end their running decode iteration and the migration (`send_recv` profile) is done; KV that cannot move stays and its decodes stall (either way) |
| scale-up: add the instance with the fewest used slots while eq. (3) latency gain > eq. (4) migration cost | §5.2 | - |
| batching: DP of eq. (5) over length-sorted requests and (node, unused slots)-sorted instances | §5.3 | O(n^2 m^2) DP without the quadrangle-inequality speed-up (none: same result) |
| scale-down after prefill to the fewest instances that hold the KV; proactive migration overlaps the KV transfer with the prefill | §4.1, §5.4 | transfer timed by `send_recv`; only the part longer than the prefill delays the first decode (either way) |
| multi-master decoding: each request's linear layers run on its master only, attention where its KV lies; new KV spread evenly over masters | §4.2, §5.4 | query/output exchange taken as overlapped; an instance's attention reads the context in proportion to the KV it holds (favours LoongServe) |
| decode scale-up: an instance mastering more decodes than the compute-bound batch size hands half to an idle instance, moving only unwritten KV reservations | §4.2, §5.4 | threshold from the time model (batch time 2x a one-row batch's), not profiled; no memory-driven scale-up, since dispatch reserves each request's maximum KV (either way) |
| prefill time on d instances: striped attention splits tokens and causal attention evenly | §2.3 | ring KV passes taken as hidden under attention (favours LoongServe) |
| decode scale-down within the decode phase (optional in the paper) | §4 | not modelled (against LoongServe, slightly) |

**vLLM-like** (`sarathi`): vLLM's scheduler for long contexts is Sarathi-Serve (Medha §6.1):
decodes first, then FCFS prefill chunks of 512 tokens, on the same TP8 x SPP2 mesh as lars.
"""  # noqa: E501  (a markdown table: one row a line)


COMMENTARY = """## Commentary (hand-written, not computed from this run)

- Goodput counts a rate only when the long requests meet their own deadline too, so a
  policy cannot buy short-request latency by starving long prompts; the tables above say
  which attainment binds at each policy's goodput.
- In the LoongServe model a short request waits behind a long prefill only when no instance
  is idle at its arrival (each one prefilling or holding decode KV); how often that happens
  shows in the gap between its TTFT median and its tail in the tables above.
- The saturation QPS is the time model's estimate of work per request and ignores queueing,
  so a goodput above it is possible only where the SLOs tolerate a growing queue over the
  run's length.
- Medha-SWE is not public: the long requests are a log-normal fitted to its published
  P50/P90, and the results depend on how many long prompts a sample draws.
- The live engine's convoy at real length (CPU, tiny model) is in docs/convoy.md.
"""


def write(ld: Load, jobs: int, out_dir: Path, quick: bool) -> str:
    """Every run, the page written to ``out_dir/reproduction.md`` (figures under
    ``out_dir/reproduction/``); the page's text."""
    figs = out_dir / "reproduction"
    figs.mkdir(parents=True, exist_ok=True)
    runs = run_all(ld, jobs, figs)
    lines = (_intro(ld, runs, jobs, quick) + _goodput(ld, runs) + _loads(ld, runs)
             + _time_model(figs) + ["", reflow(COMMENTARY)])
    (out_dir / "reproduction.md").write_text("\n".join(lines).rstrip() + "\n")
    return "\n".join(lines)


def _intro(ld: Load, runs: Runs, jobs: int, quick: bool) -> list[str]:
    n, lengths = ld.n, ld.lengths
    lines = ["# Medha's figures on the simulator", "",
             f"Generated by `python scripts/medha_reproduction.py{' --quick' if quick else ''}`"
             f" ({runs.wall:.0f} s of runs, {jobs} processes). Llama-3 8B, 16 A100s: every "
             "policy of `jserve simulate` on TP8 x SPP2 (`sarathi` is the vLLM-like baseline), "
             "LoongServe on eight TP-2 elastic instances (Medha §6.2). Workload: ShareGPT4 "
             "shorts + 5% synthetic Medha-SWE long requests (128K-1M tokens), Poisson "
             f"arrivals, {n} requests ({sum(t.prompt_tokens >= LONG for t in lengths)} long), "
             f"seed {ld.seed}. Every run goes on until every request finishes.", "",
             "## Saturation QPS (time model)", "", "| policy | saturation QPS |", "|---|---:|"]
    lines += [f"| {p} | {v:.3f} |" for p, v in ld.sat.items()]
    return lines + ["", BASELINES]


def _goodput(ld: Load, runs: Runs) -> list[str]:
    good, at_loong = runs.good, runs.at_loong
    loong_g = good["loongserve"]["goodput"]
    lines = ["## Goodput (the headline)", "",
             f"The highest arrival rate at which at least {GOODPUT.attainment:.0%} of short "
             f"requests get their first token within {GOODPUT.short_ttft_s:g} s, at least "
             f"{GOODPUT.attainment:.0%} of long ones (prompt >= {LONG} tokens) within "
             f"{GOODPUT.long_ttft_factor:g}x their isolated TTFT on lars's mesh "
             "(`jserve.sim.policies.isolated_ttfts`, the same deadline for every system), "
             f"and at least {GOODPUT.attainment:.0%} of all requests within "
             f"{GOODPUT.tpot_s:g} s TPOT; bisection (`jserve.sim.goodput`) over QPS on one "
             f"trace (arrivals scaled), to {GOODPUT_TOL:.0%}, started between half the "
             "policy's saturation and its saturation. Attainments at the goodput rate:", ""]
    lines += goodput_table(good, ld.sat)
    lines += ["", "### Targets", ""]
    lines += targets_table(good, ld.sat, at_loong, *short_floors(ld))
    lines += ["", f"At loongserve's goodput ({loong_g:.3f} QPS): short TTFT P50 / P90 / P99 "
              + "; ".join(f"{p} " + " / ".join(fmt(at_loong[p][f"short_ttft_p{q}"], 3)
                                              for q in (50, 90, 99)) + " s"
                          for p in ("lars", "loongserve"))
              + "; long TTFT P50 " + "; ".join(f"{p} {fmt(at_loong[p]['long_ttft_p50'], 1)} s"
                                               for p in ("lars", "loongserve")) + ".", "",
              "Rates each bisection tried (QPS: short / long / TPOT attainment):", ""]
    for p in POLICIES:
        lines.append(f"- {p}: " + "; ".join(
            f"{q:.3f}: {v['short']:.0%} / {v['long']:.0%} / {v['tpot']:.0%}"
            for q, v in good[p]["tried"]))
    return lines


def _loads(ld: Load, runs: Runs) -> list[str]:
    lines = ["", "## Short-request TTFT at 80% of each policy's own saturation", ""]
    lines += own_load_table(runs.own)
    lines += ["", "## The three systems at one load (Medha Figs. 1a, 9b, 10)", "",
              "![headline](reproduction/headline.png) ![paper load](reproduction/paper_load.png)",
              "", f"Short requests' TTFT deadline here: the deadline policies' default "
              "(`jserve.sim.policies.default_ttft_deadlines`); goodput column: requests per "
              f"second meeting TTFT <= max({SLO.ttft_s} s, {SLO.ttft_per_token_s * 1e3:.1f} ms "
              f"x prompt tokens) and TPOT <= {SLO.tpot_s} s.", ""]
    lines += comparison_table(runs.rows)
    lines += ["", "## lars's TTFT-deadline attainment with each ordering rule off", "",
              "The rules are `jserve.scheduler.deadline`'s: the pipeline's last pass in the "
              "slack (drain), due requests first, and quick first (`docs/scheduler.md`). "
              f"`python scripts/medha_reproduction.py --attainment-only` prints this table "
              f"alone ({ld.n} requests, seed {ld.seed}, {ld.qps} QPS):", ""]
    lines += attainment_table(sorted(
        [r for r in runs.runs if r["policy"] in VARIANTS]
        + [r for r in runs.runs if r["policy"] == "lars" and r["qps"] == ld.qps],
        key=ablation_order))
    return lines


def _time_model(figs: Path) -> list[str]:
    lines = ["", "## 1M-token prefill time against SPP degree (Medha Fig. 11 / §4)", "",
             "Llama-3 70B, H100, TP8 per stage, isolated prefill with 32K-token chunks.", "",
             "![spp](reproduction/spp_scaling.png)", ""] + spp_scaling(figs)
    lines += ["", "## Decode TPOT at long context against KVP degree (Medha Fig. 12)", "",
              "Llama-3 70B, H100, TP8 per KV group; one long decode beside 32 short ones.", "",
              "![kvp](reproduction/kvp_tpot.png)", ""] + kvp_tpot(figs)
    lines += ["", "## The time model against the Vidur profiles (held-out rows)", "",
              "Per-layer non-attention time (the ops of `mlp.csv`), curve built from every "
              "other profiled token count, error on the others:", ""] + profile_error()
    return lines

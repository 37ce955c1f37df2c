"""The convoy-effect benchmark on the live engine (``scripts/convoy_benchmark.py``,
docs/convoy.md): one trace of short chats with a few long documents mixed in, run against
fcfs (non-preemptive, the convoy baseline), sarathi, edf and lars on the built-in default
model, with the ratios against fcfs and the pass/fail lines of the claims; or a sweep over
seeds and loads; or the workload through a running server."""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

from harness.evaluate import (
    ensure_predictor,
    evaluate,
    local_runner,
    ratio_table,
    release_executables,
    remote_runner,
    write_plots,
)
from harness.workload import WorkloadSpec, build_workload, model_len_for
from jserve.bench.metrics import Slo, ratio, summarize
from jserve.sim.trace import write_records

POLICIES = ("fcfs", "sarathi", "edf", "lars")


CPU = WorkloadSpec(num_requests=200, long_fraction=0.05, qps=2.0, short_scale=1 / 4,
                   long_scale=1 / 32, output_scale=1 / 4, min_tokens=64, seed=0)


CPU_ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256, kv_cache_bytes=2 << 30,
                  iteration_budget=0.05)


# Seconds on any machine: tiny lengths and the test suite's engine shapes (compiled once).
SMOKE = WorkloadSpec(num_requests=8, long_fraction=0.25, qps=8.0, short_scale=1 / 512,
                     long_scale=1 / 4096, output_scale=1 / 64, min_tokens=4, seed=0)


SMOKE_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_seqs=2,
                    max_model_len=512, warmup=False)


def checks(results) -> list[tuple[str, bool]]:
    """The claims: lars vs fcfs short TTFT P50 >= 10x and P90 >= 30x lower, lars short TPOT
    P90 no worse than sarathi's, every long request completed under lars."""
    s = {r.policy: r.summary for r in results}
    lars, fcfs, sarathi = s["lars"], s["fcfs"], s["sarathi"]
    p50 = ratio(fcfs["short_ttft_p50"], lars["short_ttft_p50"])
    p90 = ratio(fcfs["short_ttft_p90"], lars["short_ttft_p90"])
    return [
        (f"lars short TTFT P50 {p50:.1f}x lower than fcfs (>= 10x)", p50 >= 10),
        (f"lars short TTFT P90 {p90:.1f}x lower than fcfs (>= 30x)", p90 >= 30),
        (f"lars short TPOT P90 {lars['short_tpot_p90'] * 1e3:.1f} ms <= sarathi "
         f"{sarathi['short_tpot_p90'] * 1e3:.1f} ms",
         not lars["short_tpot_p90"] > sarathi["short_tpot_p90"]),
        (f"lars completed {lars['long_completed']}/{lars['long']} long requests",
         lars["long_completed"] == lars["long"]),
    ]


SLO = Slo(ttft_s=0.5, ttft_per_token_s=2e-3, tpot_s=0.2)  # the CPU figures (see main)


def deadline_attainment(scheduler, records: list[dict], long_prompt_tokens: int) -> dict:
    """Share of short / long / all requests whose first token came within the TTFT deadline
    the deadline-aware ``scheduler`` gave them (its ``DeadlineConfig``: k x the isolated
    prefill of its prefill-time cache, at least the floor); empty for other policies."""
    cache, config = getattr(scheduler, "cache", None), getattr(scheduler, "config", None)
    if cache is None or not hasattr(config, "ttft_floor"):
        return {}
    met = {"short": [], "long": []}
    for r in records:
        due = max(config.ttft_k * cache.remaining(r["prompt_tokens"], 0), config.ttft_floor)
        ok = r["first_token_s"] is not None and r["first_token_s"] - r["arrival_s"] <= due
        met["long" if r["prompt_tokens"] >= long_prompt_tokens else "short"].append(ok)
    met["all"] = met["short"] + met["long"]
    return {f"{g}_attainment": sum(v) / len(v) if v else math.nan for g, v in met.items()}


def sweep(spec: WorkloadSpec, engine: dict, seeds: list[int], loads: list[float],
          policies: list[str], out_dir: Path, progress: bool, profile: bool = True
          ) -> list[dict]:
    """Every policy on every (load, seed) trace. One engine per policy serves all its traces
    (so each policy compiles once), with prefix caching off: a seed's prompts are the same
    token ids at every load and must not be found cached the second time."""
    from jserve import LLM
    from jserve.bench.replay import run_local

    traces = {(q, s): build_workload(dataclasses.replace(spec, qps=q, seed=s))
              for q in loads for s in seeds}
    engine = dict(engine, enable_prefix_caching=False)
    engine.setdefault("max_model_len", max(model_len_for(t) for t in traces.values()))
    if profile:
        ensure_predictor("default", max_context=engine["max_model_len"],
                         **{k: v for k, v in engine.items()
                            if k not in ("iteration_budget", "max_model_len")})
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for policy in policies:
        t0 = time.perf_counter()
        llm = LLM("default", scheduler=policy, **engine)
        print(f"== {policy}: engine ready in {time.perf_counter() - t0:.0f}s", flush=True)
        for (qps, seed), trace in traces.items():
            t0 = time.perf_counter()
            records = run_local(llm.engine, trace, seed=seed, progress=progress)
            write_records(out_dir / f"records-{policy}-qps{qps:g}-seed{seed}.jsonl", records)
            row = {"policy": policy, "qps": qps, "seed": seed,
                   "wall_s": time.perf_counter() - t0,
                   **summarize(records, long_prompt_tokens=spec.long_prompt_tokens, slo=SLO),
                   **deadline_attainment(llm.engine.scheduler, records,
                                         spec.long_prompt_tokens)}
            rows.append(row)
            print(f"   {qps:g} QPS seed {seed} ({row['wall_s']:.0f}s): short TTFT P50 "
                  f"{row['short_ttft_p50']:.3f}s P90 {row['short_ttft_p90']:.3f}s, long "
                  f"completed {row['long_completed']}/{row['long']}"
                  + (f", short attainment {row['short_attainment']:.0%}"
                     if "short_attainment" in row else ""), flush=True)
        del llm
        release_executables()
    (out_dir / "sweep.json").write_text(json.dumps(
        {"workload": spec.describe(), "engine": engine, "seeds": seeds, "loads": loads,
         "runs": rows}, indent=1, default=str))
    return rows


def _spread(values: list[float], fmt: str) -> str:
    """median [min-max] of finite values (inf counts as a value: 'inf')."""
    def f(v):
        return "inf" if math.isinf(v) else format(v, fmt)
    return f"{f(statistics.median(values))} [{f(min(values))}-{f(max(values))}]"


def sweep_table(rows: list[dict], policies: list[str], subject: str = "lars") -> str:
    """Per load: the subject's short-TTFT ratio against each other policy at P50 and P90
    (median over seeds [min-max]), its own short TTFT, TPOT P50 and deadline attainment."""
    others = [p for p in policies if p != subject]
    head = (["load (QPS)", "seeds"] + [f"vs {p} P50 / P90" for p in others]
            + [f"{subject} short TTFT P50 / P90 (s)", f"{subject} short TPOT P50 (ms)"]
            + [f"{p} short TPOT P50 (ms)" for p in others]
            + [f"{subject} short attainment", f"{subject} all attainment", "long completed"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for qps in sorted({r["qps"] for r in rows}):
        at = {(r["policy"], r["seed"]): r for r in rows if r["qps"] == qps}
        seeds = sorted({s for _, s in at})
        me = [at[subject, s] for s in seeds]
        cells = [f"{qps:g}", str(len(seeds))]
        for p in others:
            cells.append(" / ".join(_spread([ratio(at[p, s][f"short_ttft_p{q}"],
                                                   at[subject, s][f"short_ttft_p{q}"])
                                             for s in seeds], ".1f") + "x" for q in (50, 90)))
        cells.append(" / ".join(_spread([m[f"short_ttft_p{q}"] for m in me], ".3f")
                                for q in (50, 90)))
        for p in [subject] + others:
            cells.append(_spread([at[p, s]["short_tpot_p50"] * 1e3 for s in seeds], ".0f"))
        for g in ("short", "all"):
            vals = [m.get(f"{g}_attainment", math.nan) for m in me]
            cells.append(_spread([v * 100 for v in vals], ".0f") + "%")
        cells.append(", ".join(f"{p} {sum(at[p, s]['long_completed'] for s in seeds)}/"
                               f"{sum(at[p, s]['long'] for s in seeds)}" for p in policies))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_sweep(spec: WorkloadSpec, engine: dict, seeds: list[int], loads: list[float],
              policies: list[str], out_dir: Path, progress: bool, profile: bool) -> int:
    """``sweep``, its table printed and written to ``out_dir/sweep.md``."""
    t0 = time.perf_counter()
    rows = sweep(spec, engine, seeds, loads, policies, out_dir, progress=progress,
                 profile=profile)
    table = sweep_table(rows, policies)
    print(spec.describe())
    print(table)
    (out_dir / "sweep.md").write_text(spec.describe() + "\n\n" + table + "\n")
    print(f"{time.perf_counter() - t0:.0f}s; wrote {out_dir}/ (records-*.jsonl, "
          "sweep.json, sweep.md)")
    return 0


def run_remote(spec: WorkloadSpec, target: str, out_dir: Path, progress: bool,
               auth_token: str | None) -> int:
    """The workload through the server at ``target`` (it runs its own policy)."""
    run = remote_runner(target, seed=spec.seed, progress=progress, auth_token=auth_token)
    results = evaluate(spec, ["server"], run, out_dir=out_dir, slo=SLO)
    print(ratio_table(results, "server"))
    print(f"wrote {out_dir}/ (one policy: the server's; the checks need all four)")
    return 0


def run_policies(spec: WorkloadSpec, engine: dict, policies: list[str], out_dir: Path,
                 progress: bool, smoke: bool) -> int:
    """Every policy on the trace in process: records, summaries, plots, the ratio table and
    the claims' PASS / FAIL lines; exit status 1 when a claim failed."""
    if not smoke:  # the smoke run checks plumbing only; it leaves the saved predictor be
        max_len = model_len_for(build_workload(spec))
        ensure_predictor("default", max_context=max_len,
                         **{k: v for k, v in engine.items() if k != "iteration_budget"})
    run = local_runner("default", seed=spec.seed, progress=progress, **engine)
    # TTFT SLO: 0.5 s, or 2 ms a prompt token for long prompts; TPOT SLO 0.2 s (CPU figures).
    results = evaluate(spec, policies, run, out_dir=out_dir, slo=SLO)
    write_plots(results, out_dir, title=spec.describe(),
                long_prompt_tokens=spec.long_prompt_tokens)
    print(ratio_table(results, "fcfs"))
    ok = True
    for line, passed in (checks(results) if {"fcfs", "sarathi", "lars"} <= set(policies)
                         else []):
        print(("PASS " if passed else "FAIL ") + line)
        ok &= passed
    print(f"wrote {out_dir}/ (records-*.jsonl, summary.json, ttft_cdf.png, tpot.png)")
    return 0 if ok else 1

"""One workload against several policies (and loads): runs, record files, summaries, plots,
and ratios against a baseline policy. The scripts in ``scripts/`` are thin wrappers of this."""
from __future__ import annotations

import dataclasses
import json
import math
import textwrap
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from harness import plots
from harness.workload import WorkloadSpec, build_workload, model_len_for
from jserve.bench.metrics import Slo, format_summary, ratio, summarize
from jserve.sim.trace import TraceRequest, write_records, write_trace

Runner = Callable[[str, Sequence[TraceRequest]], list[dict]]  # (policy, trace) -> records
RATIO_KEYS = ("short_ttft_p50", "short_ttft_p90", "short_ttft_p99", "long_ttft_p50",
              "short_tpot_p90", "short_tbt_p99")


def local_runner(model: str = "default", *, window_s: float | None = None, seed: int = 0,
                 progress: bool = True, **engine_kwargs) -> Runner:
    """Runs each policy on a fresh in-process engine (``LLM(model, scheduler=policy, ...)``);
    ``max_model_len`` defaults to ``model_len_for(trace)``, so every policy compiles the same
    shapes (the persistent XLA cache then serves the later ones)."""
    from jserve import LLM
    from jserve.bench.replay import run_local

    def run(policy: str, trace: Sequence[TraceRequest]) -> list[dict]:
        kwargs = {"max_model_len": model_len_for(trace), **engine_kwargs}
        llm = LLM(model, scheduler=policy, **kwargs)
        try:
            return run_local(llm.engine, trace, window_s=window_s, seed=seed,
                             progress=progress)
        finally:
            del llm
            release_executables()
    return run


def release_executables() -> None:
    """JAX keeps every compiled executable after its engine is gone (hundreds of memory maps
    each on CPU); a process that builds engine after engine would pass vm.max_map_count and
    fail to compile. Dropping them between engines keeps the count bounded."""
    import gc

    import jax

    gc.collect()
    jax.clear_caches()


def remote_runner(target: str, *, window_s: float | None = None, seed: int = 0,
                  progress: bool = True, auth_token: str | None = None) -> Runner:
    """``target`` is a running ``jserve serve``'s gRPC ``host:port``, or ``http://host:port``
    of any OpenAI-compatible server (jserve's HTTP API or another). The server runs
    whichever policy it was started with; ``policy`` is only a label."""
    import asyncio

    from jserve.bench.replay import run_http, run_remote

    over = run_http if target.startswith(("http://", "https://")) else run_remote

    def run(policy: str, trace: Sequence[TraceRequest]) -> list[dict]:
        records = asyncio.run(over(target, trace, window_s=window_s, seed=seed,
                                   progress=progress, auth_token=auth_token))
        return [{**r, "policy": policy} for r in records]
    return run


def ensure_predictor(model: str, *, max_context: int, log: Callable[[str], None] = print,
                     **engine_kwargs) -> Path:
    """The deadline-aware policies pack batches with the predictor ``jserve profile`` saves.
    One fitted on shorter contexts than the workload's (or none) is re-profiled here on an
    engine with these settings and saved where every engine looks, so the compared policies
    all plan with the same, measured model."""
    from jserve import LLM
    from jserve.engine.config import EngineConfig
    from jserve.engine.loop.profiler import LONG_GRID_TOKENS, fit_predictor, profile_samples
    from jserve.engine.loop.timing import default_predictor_path
    from jserve.model.weights import load_config
    from jserve.scheduler.predictor import LinearPredictor

    kwargs = dict(engine_kwargs, max_model_len=max_context)
    path = default_predictor_path(load_config(model), EngineConfig(**kwargs))
    want = min(max_context, LONG_GRID_TOKENS)
    if path.exists() and LinearPredictor.load(path).meta.get("max_context", 0) >= want - 16:
        return path
    llm = LLM(model, scheduler="sarathi", **kwargs)
    log(f"profiling the engine up to {want} tokens of context for {path} (a few minutes)")
    predictor, report = fit_predictor(llm.engine, profile_samples(llm.engine))
    predictor.save(path)
    del llm
    release_executables()
    log(f"held-out median relative error {report['held_out_median_rel_error']:.1%}, "
        f"p90 {report['held_out_p90_rel_error']:.1%}")
    return path


@dataclasses.dataclass
class PolicyResult:
    policy: str
    qps: float | None
    records: list[dict]
    summary: dict
    wall_s: float


def evaluate(spec: WorkloadSpec, policies: Iterable[str], run: Runner, *, out_dir: Path,
             slo: Slo = Slo(), qps_points: Sequence[float] | None = None,
             log: Callable[[str], None] = print) -> list[PolicyResult]:
    """Every policy on the workload (at each of ``qps_points`` when given: the same requests
    and unit-rate arrivals, rescaled). Writes ``trace[-qps].csv``, ``records-POLICY[-qps].jsonl``
    and ``summary.json`` under ``out_dir`` and logs each summary as it comes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    points = list(qps_points) if qps_points else [spec.qps]
    results = []
    log(spec.describe())
    for qps in points:
        point = dataclasses.replace(spec, qps=qps) if qps_points else spec
        suffix = f"-qps{qps:g}" if qps_points else ""
        trace = build_workload(point)
        write_trace(out_dir / f"trace{suffix}.csv", trace)
        for policy in policies:
            t0 = time.perf_counter()
            records = run(policy, trace)
            wall = time.perf_counter() - t0
            write_records(out_dir / f"records-{policy}{suffix}.jsonl", records)
            s = summarize(records, long_prompt_tokens=spec.long_prompt_tokens, slo=slo)
            results.append(PolicyResult(policy, qps, records, s, wall))
            log(f"== {policy}{' at ' + str(qps) + ' QPS' if qps_points else ''} "
                f"({wall:.0f}s)\n{format_summary(s)}")
    (out_dir / "summary.json").write_text(json.dumps(
        {"workload": spec.describe(), "slo": dataclasses.asdict(slo),
         "runs": [{"policy": r.policy, "qps": r.qps, "wall_s": r.wall_s, **r.summary}
                  for r in results]}, indent=1, default=str))
    return results


def write_plots(results: Sequence[PolicyResult], out_dir: Path, *, title: str,
                long_prompt_tokens: int) -> list[Path]:
    """TTFT CDF and TPOT bars of the first load point; the QPS sweep when there are several."""
    first = [r for r in results if r.qps == results[0].qps]
    title = textwrap.fill(title, 120)
    paths = [out_dir / "ttft_cdf.png", out_dir / "tpot.png"]
    plots.ttft_cdf({r.policy: r.records for r in first}, paths[0], title=title,
                   long_prompt_tokens=long_prompt_tokens)
    plots.tpot_bars({r.policy: r.summary for r in first}, paths[1], title=title)
    if len({r.qps for r in results}) > 1:
        paths.append(out_dir / "qps_sweep.png")
        plots.qps_sweep([{"policy": r.policy, "qps": r.qps, **r.summary} for r in results],
                        paths[2], title=title)
    return paths


def _x(v: float) -> str:
    return "-" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v:.1f}x")


def _t(v: float) -> str:
    return "-" if math.isnan(v) else ("never" if math.isinf(v) else f"{v:.3f}")


def ratio_table(results: Sequence[PolicyResult], baseline: str = "fcfs",
                keys: Sequence[str] = RATIO_KEYS) -> str:
    """Markdown: each metric (seconds) per policy and how many times lower than the
    baseline's at the same load, plus long-request completions."""
    lines = ["| policy | QPS | " + " | ".join(keys) + " | long completed |",
             "|---|---:|" + "---:|" * (len(keys) + 1)]
    base = {r.qps: r.summary for r in results if r.policy == baseline}
    for r in results:
        b = base.get(r.qps)
        cells = [_t(r.summary[k]) + (f" ({_x(ratio(b[k], r.summary[k]))})"
                                     if b is not None and r.policy != baseline else "")
                 for k in keys]
        qps = "replay" if r.qps is None else f"{r.qps:g}"
        lines.append(f"| {r.policy} | {qps} | " + " | ".join(cells)
                     + f" | {r.summary['long_completed']}/{r.summary['long']} |")
    return "\n".join(lines)

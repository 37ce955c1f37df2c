"""A mixed serving trace: many requests with heavy-tailed prompt lengths (1 to a few
thousand tokens), 1-200 output tokens, arriving in waves, run through the offline engine; and
what it shows about the step programs: how many compiled at start and how many during the
trace, how many steps ran padded up to a larger compiled shape than their own, how full the
steps' token slots were, and the trace's wall time (``scripts/bench_program_set.py``).

Each measurement runs in a fresh process (``child``), so start-up is timed with the
persistent compilation cache empty (a new directory) or warm (the same directory again)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from jserve.sim.trace import TraceRequest


def mixed_trace(num_requests: int = 120, max_prompt: int = 6000, max_output: int = 200,
                waves: int = 4, wave_gap_s: float = 10.0, median_prompt: int = 200,
                seed: int = 0) -> list[TraceRequest]:
    """Prompt lengths log-normal (median ``median_prompt``, sigma 1.3: about 4% of prompts
    above 10x the median) clipped to [1, max_prompt], with the longest prompt forced to
    ``max_prompt`` so the tail is always there; outputs uniform in [1, max_output]; the
    requests arrive in ``waves`` equal groups ``wave_gap_s`` apart (all of a wave at once)."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(np.round(rng.lognormal(np.log(median_prompt), 1.3, num_requests)),
                      1, max_prompt).astype(int)
    prompts[int(np.argmax(prompts))] = max_prompt
    outputs = rng.integers(1, max_output + 1, num_requests)
    per_wave = -(-num_requests // waves)
    return [TraceRequest(f"r{i}", (i // per_wave) * wave_gap_s, int(p), int(o))
            for i, (p, o) in enumerate(zip(prompts, outputs))]


def step_stats(engine) -> dict:
    """From ``engine.step_log`` (plans) and the runner's counters: steps, the share that ran
    padded up to a larger compiled shape than their own bucket (``StepPrograms.padded``),
    and the share of token slots that held a real token (the rest is bucket padding)."""
    buckets, programs = engine.buckets, engine.runner.programs
    real = slots = 0
    for plan, _ in engine.step_log:
        prefill = sum(c.num_tokens for c in plan.prefills)
        shape = buckets.shape_for(plan.num_decode_rows, prefill)
        real += plan.num_decode_rows + prefill
        slots += sum(shape)
    steps = len(engine.step_log)
    padded = sum(getattr(programs, "padded", {}).values())
    return {"steps": steps, "padded_up_steps": padded,
            "padded_up_share": padded / steps if steps else 0.0,
            "token_fill": real / slots if slots else 0.0,
            "shapes_run": sorted([list(k), v] for k, v in engine.runner.executed.items())}


def child(args) -> dict:
    """One fresh process: build ``LLM(args.model)`` with the given cache directory and
    settings, then run the trace (unless ``args.start_only``)."""
    from jserve import LLM
    from jserve.bench.replay import run_local

    t0 = time.perf_counter()
    kwargs = json.loads(args.engine_kwargs or "{}")
    llm = LLM(args.model, compilation_cache_dir=args.cache_dir, **kwargs)
    built = time.perf_counter() - t0
    eng = llm.engine
    programs = eng.runner.programs
    startup = eng.startup.as_dict()
    out = {"jserve": os.path.dirname(sys.modules["jserve"].__file__), "startup": startup,
           "engine_s": built, "summary": getattr(eng, "startup_summary", ""),
           "programs_at_start": programs.compile_count,
           "step_shapes": len(eng.buckets.all_shapes()), "warmup": eng.config.warmup,
           "compile_times": getattr(programs, "compile_times", {})}
    if args.start_only:
        return out
    trace = mixed_trace(args.requests, args.max_prompt, args.max_output, args.waves,
                        args.wave_gap, seed=args.seed)
    eng.step_log = []
    t0 = time.perf_counter()
    records = run_local(eng, trace, seed=args.seed, progress=False)
    out["trace_s"] = time.perf_counter() - t0
    out["programs_during_trace"] = programs.compile_count - out["programs_at_start"]
    if hasattr(programs, "wait_compiles"):  # background compiles the trace started
        programs.wait_compiles(timeout=900)
    out["programs_total"] = programs.compile_count
    out["output_tokens"] = sum(r["output_tokens"] for r in records)
    out["prompt_tokens"] = sum(t.prompt_tokens for t in trace)
    out.update(step_stats(eng))
    return out


def spawn(args_list: list[str], timeout: float = 3600, pythonpath: str | None = None) -> dict:
    """Runs ``child`` in a fresh Python process (``python -m harness.mixed_trace``) and
    returns its JSON result. ``pythonpath``: the jserve tree to measure (another checkout,
    e.g. ``git archive`` of an older commit), ahead of this module's ``scripts/`` (whose
    ``harness`` the child runs whatever the tree); the child runs in the temporary
    directory, so the current directory never shadows it."""
    env = dict(os.environ)
    scripts = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    jserve_path = pythonpath or os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([x for x in [jserve_path] if x] + [scripts])
    proc = subprocess.run([sys.executable, "-m", "harness.mixed_trace", *args_list],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def study(label: str, pythonpath: str | None, trace_args: list[str], engine_kwargs: str | None,
          cache_root: str) -> list[dict]:
    """A cold start (a new, empty cache directory) with the trace, then a warm start (the
    same directory) with the trace again; each row says the machine's load before and
    after."""
    cache = tempfile.mkdtemp(prefix=f"{label}-", dir=cache_root)
    rows = []
    for start in ("cold", "warm"):
        before = load_average()
        args = ["--cache-dir", cache, *trace_args]
        if engine_kwargs:
            args += ["--engine-kwargs", engine_kwargs]
        row = spawn(args, pythonpath=pythonpath)
        row.update(label=label, start=start, load_before=before, load_after=load_average())
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of ``study`` rows."""
    head = ("| run | start | warmup | step shapes | programs at start / during trace / total | "
            "ready s | programs s (compile s summed) | cached / compiled | trace s | steps | "
            "padded up | token fill | load before -> after |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        st = r["startup"]
        out.append(
            f"| {r['label']} | {r['start']} | {r['warmup']} | {r['step_shapes']} | "
            f"{r['programs_at_start']} / {r.get('programs_during_trace', '-')} / "
            f"{r.get('programs_total', '-')} | {st['ready']:.1f} | {st['programs']:.1f} "
            f"({st.get('compile_seconds', 0):.1f}) | {st['cached']} / {st['compiled']} | "
            f"{r.get('trace_s', 0):.1f} | {r.get('steps', '-')} | "
            f"{100 * r.get('padded_up_share', 0):.0f}% | {100 * r.get('token_fill', 0):.0f}% | "
            f"{r['load_before']} -> {r['load_after']} |")
    return "\n".join(out)


def _main() -> None:
    import argparse
    p = argparse.ArgumentParser(description="one measurement of the mixed trace (a child)")
    p.add_argument("--model", default="default")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--engine-kwargs", default=None, help="JSON of LLM keyword arguments")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--max-prompt", type=int, default=6000)
    p.add_argument("--max-output", type=int, default=200)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--wave-gap", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-only", action="store_true")
    args = p.parse_args()
    result = child(args)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main()

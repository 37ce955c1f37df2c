"""The start-up benchmark (``scripts/bench_startup.py``): engine starts, each in a fresh
process (``startup_children``), cold (an empty persistent compilation cache) and warm (the
same cache again), with JAX's compile events and the engine's own phases; the tables it
prints. The script parses the flags and re-runs itself as the children."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from harness.compile_components import child_components, parse_shape
from harness.startup_children import child_first_token, child_lower_all, child_start

CHILDREN = {"start": child_start, "lower_all": child_lower_all,
            "components": child_components, "first_token": child_first_token}


def run_child(args) -> None:
    """A child process: the measurement ``args._child`` names, its dict written to
    ``args._result`` as JSON."""
    args.depth = args._depth
    out = CHILDREN[args._child](args)
    with open(args._result, "w") as f:
        json.dump(out, f)


def load() -> dict:
    one, five, fifteen = os.getloadavg()
    return {"load1": round(one, 2), "load5": round(five, 2), "load15": round(fifteen, 2),
            "cpus": os.cpu_count()}


def make_hf_dir(path: str, depth: int, hidden: int, vocab: int) -> None:
    import torch
    import transformers
    torch.manual_seed(0)
    inter = 688 if hidden == 256 else int(hidden * 8 / 3 + 63) // 64 * 64
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=depth,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)


def first_token_table(rows: list[dict]) -> str:
    lines = ["| depth | start | first token s | 4th token s | imports s | weights s | KV s "
             "| programs s | cached / compiled / deferred | trace / lower / backend s "
             "| load1 before -> after |", "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['depth']} | {r['kind']} | {r['error']} |" + " |" * 8)
            continue
        st = r["startup"]
        lines.append(
            f"| {r['depth']} | {r['kind']} | {r['first_token_s']:.1f} | "
            f"{r['fourth_token_s']:.1f} | {st['before_engine']:.1f} | {st['weights']:.1f} | "
            f"{st['kv']:.1f} | {st['programs']:.1f} | {st['cached']} / {st['compiled']} / "
            f"{st['deferred']} | {r['trace_s']:.1f} / {r['lower_s']:.1f} / "
            f"{r['backend_compile_s']:.1f} | {r['load1_before']:.2f} -> "
            f"{r['load1_after']:.2f} |")
    return "\n".join(lines)


def run_first_token(args, script: str) -> None:
    """``--setup first-token``: per depth a cold start and ``--reps`` warm ones, each a fresh
    process of ``script``; the table, and ``--out``."""
    from tqdm import tqdm
    depths = [int(d) for d in args.depths.split(",") if d]
    report = {"argv": sys.argv, "load_start": load(), "setup": "first-token",
              "warmup": args.warmup, "rows": []}
    print(f"load at start: {report['load_start']}", flush=True)
    root = tempfile.mkdtemp(prefix="jserve_bench_startup_")
    jobs = [(d, kind) for d in depths for kind in ["cold"] + ["warm"] * args.reps]
    try:
        for d in tqdm(sorted(set(depths)), desc="writing HF checkpoints"):
            make_hf_dir(os.path.join(root, f"hf{d}"), d, args.hidden, args.vocab)
        bar = tqdm(jobs, desc="starts")
        for d, kind in bar:
            bar.set_postfix_str(f"{kind} depth {d} load {os.getloadavg()[0]:.1f}")
            before = os.getloadavg()[0]
            r = spawn(args, script, "first_token", d,
                      ["--_cache-dir", os.path.join(root, f"cache{d}"),
                       "--_model-dir", os.path.join(root, f"hf{d}"), "--warmup", args.warmup],
                      args.timeout)
            r.update(kind=kind, depth=d, load1_before=round(before, 2),
                     load1_after=round(os.getloadavg()[0], 2))
            report["rows"].append(r)
            tqdm.write(f"{kind} depth {d}: " + (r["error"] if "error" in r else
                       f"first token {r['first_token_s']:.1f}s, engine "
                       f"{r['startup']['engine']:.1f}s, tokens {r['tokens']}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["load_end"] = load()
    print(f"load at end: {report['load_end']}")
    print(f"\nProcess start to first token (LLM(<HF dir>), warmup={args.warmup!r}, 4 greedy "
          "tokens; fresh process each; cold = empty persistent cache, warm = the same cache "
          "again)\n")
    print(first_token_table(report["rows"]))
    for d in depths:
        warm = [r["first_token_s"] for r in report["rows"]
                if r["depth"] == d and r["kind"] == "warm" and "error" not in r]
        cold = [r["first_token_s"] for r in report["rows"]
                if r["depth"] == d and r["kind"] == "cold" and "error" not in r]
        if warm and cold:
            print(f"depth {d}: cold {cold[0]:.1f} s (goal < 30), warm median "
                  f"{statistics.median(warm):.1f} s of {len(warm)} (goal < 5)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")


def spawn(args, script: str, mode: str, depth: int, extra: list[str], timeout: float | None
          ) -> dict:
    """Runs ``script --_child mode`` (a child of ``startup_children``) in a fresh process;
    its result dict, with the process's wall time, or an error."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(script), "--_child", mode, "--_depth", str(depth),
           "--_result", path, "--hidden", str(args.hidden), "--vocab", str(args.vocab),
           "--shapes", args.shapes] + extra
    if args.num_kv_pages is not None:
        cmd += ["--num-kv-pages", str(args.num_kv_pages)]
    if args.verbose:
        cmd.append("--verbose")
    # The children import the jserve of the script's checkout unless PYTHONPATH names one.
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(script))))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout, env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": f"child exited {proc.returncode}: "
                             f"{proc.stderr.strip().splitlines()[-1:] if proc.stderr else ''}",
                    "process_s": wall}
        with open(path) as f:
            out = json.load(f)
        out["process_s"] = wall
        return out
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s", "process_s": time.perf_counter() - t0}
    finally:
        os.unlink(path)


def fmt(x, digits=1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def start_table(results: list[dict]) -> str:
    lines = ["| depth | cold s | warm s (median) | executables | cold trace / lower / backend s "
             "| warm trace / lower / backend s | cold cache hits / misses "
             "| warm cache hits / misses |",
             "|---:|---:|---:|---:|---|---|---|---|"]
    for r in results:
        c, w = r.get("cold") or {}, r.get("warm_median") or {}
        if "error" in c:
            c = {}
        def split(x):
            return (f"{fmt(x.get('trace_s'))} / {fmt(x.get('lower_s'))} / "
                    f"{fmt(x.get('backend_compile_s'))}" if x else "n/a")
        def hits(x):
            return f"{x.get('cache_hits')} / {x.get('cache_misses')}" if x else "n/a"
        lines.append(f"| {r['depth']} | {fmt(c.get('total_s'))} | {fmt(w.get('total_s'))} | "
                     f"{(w or c).get('executables', 'n/a')} | {split(c)} | {split(w)} | "
                     f"{hits(c)} | {hits(w)} |")
    return "\n".join(lines)


def component_table(comp: dict[int, dict], shapes: list[str]) -> str:
    names = ["decoder_layers", "attention", "sampling_sort", "penalties", "logprobs",
             "fused_step"]
    depths = sorted(comp)
    lines = ["| component | depth | shape (decodes x prefill tokens) | trace s | lower s "
             "| compile s | total s |", "|---|---:|---|---:|---:|---:|---:|"]
    for name in names:
        per_depth = name in ("decoder_layers", "fused_step")
        for d in (depths if per_depth else depths[:1]):
            for s in shapes:
                r = comp[d].get("components", {}).get(f"{name}@{s}")
                if r is None:
                    continue
                dcol = str(d) if per_depth else "-"
                if "error" in r:
                    lines.append(f"| {name} | {dcol} | {s} | n/a | n/a | n/a "
                                 f"| n/a ({r['error']}) |")
                else:
                    lines.append(f"| {name} | {dcol} | {s} | {fmt(r['trace_s'], 2)} | "
                                 f"{fmt(r['lower_s'], 2)} | {fmt(r['compile_s'], 2)} | "
                                 f"{fmt(r['total_s'], 2)} |")
    return "\n".join(lines)


def run_engine_study(args, script: str) -> None:
    """``--setup engine``: per depth a cold start and ``--reps`` warm ones of ``LLMEngine``
    (or only the trace and lowering of every bucket, for depths outside ``--start-depths``),
    then the component breakdown; each a fresh process of ``script``."""
    depths = [int(d) for d in args.depths.split(",") if d]
    cold_depths = (set(depths) if args.cold_depths is None
                   else {int(d) for d in args.cold_depths.split(",") if d})
    if args.skip_cold:
        cold_depths = set()
    shapes = [f"{d}x{q}" for d, q in map(parse_shape, args.shapes.split(","))]
    report: dict = {"argv": sys.argv, "load_start": load(), "depths": depths,
                    "hidden": args.hidden, "vocab": args.vocab, "reps": args.reps,
                    "shapes": shapes, "starts": [], "components": {}}
    print(f"load at start: {report['load_start']}", flush=True)
    jobs: list[tuple] = []
    start_depths = (set(depths) if args.start_depths is None
                    else {int(d) for d in args.start_depths.split(",") if d})
    report["start_depths"] = sorted(start_depths)
    report["lower_only"] = {}
    if not args.components_only:
        for d in depths:
            if d in start_depths:
                jobs.append(("cold", d))
                jobs += [("warm", d)] * args.reps
            else:
                jobs.append(("lower_all", d))
    if not args.skip_components:
        jobs += [("components", d) for d in depths]
    starts = {d: {"depth": d, "warm": []} for d in depths}
    _run_jobs(args, script, jobs, depths, cold_depths, starts, report)
    for d in sorted(start_depths & set(depths)):
        good = [w for w in starts[d]["warm"] if "error" not in w]
        if good:
            med = statistics.median(w["total_s"] for w in good)
            starts[d]["warm_median"] = min(good, key=lambda w: abs(w["total_s"] - med))
            starts[d]["warm_median"] = {**starts[d]["warm_median"], "total_s": med}
        report["starts"].append(starts[d])
    report["load_end"] = load()
    print(f"load at end: {report['load_end']}")
    _print_engine_study(args, report, shapes)


def _run_jobs(args, script: str, jobs: list[tuple], depths: list[int], cold_depths: set,
              starts: dict, report: dict) -> None:
    """Every (kind, depth) job in its own process, one persistent cache per depth."""
    from tqdm import tqdm
    cache_dirs = {d: tempfile.mkdtemp(prefix=f"jserve_startup_cache_d{d}_") for d in depths}
    try:
        bar = tqdm(jobs, desc="bench_startup")
        for kind, d in bar:
            bar.set_postfix_str(f"{kind} depth {d} load {os.getloadavg()[0]:.1f}")
            if kind == "lower_all":
                r = spawn(args, script, "lower_all", d, [], args.timeout)
                report["lower_only"][d] = r
                tqdm.write(f"trace+lower only, depth {d}: " + (r["error"] if "error" in r else
                           f"{r['lowered']} shapes in {r['total_s']:.1f}s (trace "
                           f"{r['trace_s']:.1f}s, lower {r['lower_s']:.1f}s)"))
                continue
            if kind == "components":
                extra = ["--_shared"] if d == depths[0] else []
                r = spawn(args, script, "components", d, extra, args.timeout)
                report["components"][d] = r
                bad = {k: v["error"] for k, v in r.get("components", {}).items() if "error" in v}
                if "error" in r or bad:
                    tqdm.write(f"components depth {d}: {r.get('error') or bad}")
                continue
            r = spawn(args, script, "start", d, ["--_cache-dir", cache_dirs[d]], args.timeout)
            r["load1_after"] = round(os.getloadavg()[0], 2)
            if kind == "cold":
                if d in cold_depths:
                    starts[d]["cold"] = r
                else:
                    starts[d]["cold_untimed"] = {"note": "cold start not reported",
                                                 "process_s": r.get("process_s")}
            else:
                starts[d]["warm"].append(r)
            tqdm.write(f"{kind} depth {d}: " + (r["error"] if "error" in r else
                       f"{r['total_s']:.1f}s, {r['executables']} executables, trace "
                       f"{r['trace_s']:.1f}s lower {r['lower_s']:.1f}s backend "
                       f"{r['backend_compile_s']:.1f}s, cache hits {r['cache_hits']} misses "
                       f"{r['cache_misses']}"))
    finally:
        for path in cache_dirs.values():
            shutil.rmtree(path, ignore_errors=True)


def _print_engine_study(args, report: dict, shapes: list[str]) -> None:
    if not args.components_only:
        print("\nEngine start (fresh process each; cold = empty persistent cache, warm = same "
              "cache again)\n")
        print(start_table(report["starts"]))
        for d, r in report["lower_only"].items():
            print(f"\ndepth {d} (no engine start): trace+lower of every bucket shape, no backend "
                  "compile: " + (r.get("error") or f"{r['lowered']} shapes, {r['total_s']:.1f}s "
                  f"(trace {r['trace_s']:.1f}s, lower {r['lower_s']:.1f}s)"))
    if report["components"]:
        print("\nComponents (AOT trace / lower / compile on abstract inputs, no persistent "
              "cache)\n")
        print(component_table(report["components"], shapes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")

"""Start-up time, process start to first token: the issue-31 setup by default.

    python scripts/bench_startup.py                      # cold + warm, 4 and 32 layers
    python scripts/bench_startup.py --depths 4 --reps 3 --warmup all
    python scripts/bench_startup.py --setup engine ...   # the older engine-only study

``--setup first-token`` (default): a random HF Llama (hidden 256, intermediate 688, vocab
32000, 4 heads / 2 KV heads of 64) is saved per depth with ``save_pretrained``; every start
is a fresh process that imports jserve, builds ``LLM(<HF dir>)`` and generates 4 greedy
tokens. "cold" uses a new, empty persistent compilation cache, "warm" the same cache again.
Each start reports the engine's own phase breakdown (``jserve.engine.startup``: imports =
process start to the engine's construction, weights, KV, programs with cached / compiled /
deferred counts), process start to first token and to the 4th token, JAX's trace / lower /
backend-compile split (monitoring events), and the machine's load before and after.

``--setup engine``: the study of docs/startup.md's earlier sections (``LLMEngine`` on
``init_params``, every bucket compiled, plus per-component AOT compiles).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# -- shared helpers ----------------------------------------------------------------------


def load() -> dict:
    one, five, fifteen = os.getloadavg()
    return {"load1": round(one, 2), "load5": round(five, 2), "load15": round(fifteen, 2),
            "cpus": os.cpu_count()}


def make_cfg(depth: int, hidden: int, vocab: int):
    from jserve.config import LlamaConfig
    inter = 688 if hidden == 256 else int(hidden * 8 / 3 + 63) // 64 * 64
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=depth, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=8192, eos_token_ids=(2,))


class EventRecorder:
    """Collects JAX monitoring events: durations and time spans per event name (spans are
    merged so nested jit traces are not counted twice), plain event counts."""

    def __init__(self):
        import jax
        self.durations: dict[str, list[float]] = {}
        self.spans: dict[str, list[tuple[float, float, str]]] = {}
        self.counts: dict[str, int] = {}
        self.active = True
        mon = jax.monitoring
        mon.register_event_duration_secs_listener(self._duration)
        mon.register_event_listener(self._event)
        try:
            from jax._src import monitoring as _mon
            _mon.register_event_time_span_listener(self._span)
            self.has_spans = True
        except (ImportError, AttributeError):
            self.has_spans = False

    def _duration(self, event, secs, **kw):
        if self.active:
            self.durations.setdefault(event, []).append(float(secs))

    def _span(self, event, start, end, **kw):
        if self.active:
            self.spans.setdefault(event, []).append((float(start), float(end),
                                                     str(kw.get("fun_name", ""))))

    def _event(self, event, **kw):
        if self.active:
            self.counts[event] = self.counts.get(event, 0) + 1

    def reset(self):
        self.durations.clear()
        self.spans.clear()
        self.counts.clear()

    def covered(self, event: str, name_filter=None) -> float:
        """Wall seconds covered by the event's spans (union of intervals); falls back to the
        sum of durations without span listeners."""
        if not self.has_spans:
            return sum(self.durations.get(event, []))
        spans = sorted((s, e) for s, e, n in self.spans.get(event, [])
                       if name_filter is None or name_filter(n))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total

    def summary(self) -> dict:
        from jax._src import dispatch
        trace = getattr(dispatch, "JAXPR_TRACE_EVENT", "/jax/core/compile/jaxpr_trace_duration")
        lower = getattr(dispatch, "JAXPR_TO_MLIR_MODULE_EVENT",
                        "/jax/core/compile/jaxpr_to_mlir_module_duration")
        backend = getattr(dispatch, "BACKEND_COMPILE_EVENT",
                          "/jax/core/compile/backend_compile_duration")
        is_step = lambda n: any(k in n for k in ("_step", "_tick", "_sample"))
        c = self.counts
        return {
            "trace_s": self.covered(trace),
            "lower_s": self.covered(lower),
            "backend_compile_s": self.covered(backend),
            "step_trace_s": self.covered(trace, is_step),
            "step_lower_s": self.covered(lower, is_step),
            "step_backend_compile_s": self.covered(backend, is_step),
            "n_traces": len(self.durations.get(trace, [])),
            "n_lowerings": len(self.durations.get(lower, [])),
            "n_backend_compiles": len(self.durations.get(backend, [])),
            "cache_requests": c.get("/jax/compilation_cache/compile_requests_use_cache", 0),
            "cache_hits": c.get("/jax/compilation_cache/cache_hits", 0),
            "cache_misses": c.get("/jax/compilation_cache/cache_misses", 0),
            "compile_time_saved_s": sum(
                self.durations.get("/jax/compilation_cache/compile_time_saved_sec", [])),
            "cache_retrieval_s": sum(
                self.durations.get("/jax/compilation_cache/cache_retrieval_time_sec", [])),
            "has_spans": self.has_spans,
        }


# -- child: one engine start -------------------------------------------------------------


def child_start(args) -> dict:
    t_import = time.perf_counter()
    import jax
    rec = EventRecorder()
    import jserve
    from jserve.engine.config import EngineConfig
    from jserve.engine.engine import LLMEngine
    from jserve.model.weights import init_params
    import_s = time.perf_counter() - t_import
    cfg = make_cfg(args.depth, args.hidden, args.vocab)
    rec.active = False
    t0 = time.perf_counter()
    params = init_params(cfg)
    jax.block_until_ready(params)
    params_s = time.perf_counter() - t0
    extra = {} if args.num_kv_pages is None else {"num_kv_pages": args.num_kv_pages}
    econf = EngineConfig(compilation_cache_dir=args.cache_dir, warmup="all", **extra)
    rec.reset()
    rec.active = True
    t0 = time.perf_counter()
    engine = LLMEngine(cfg, params, None, econf)
    jax.block_until_ready(jax.tree.leaves(engine.runner.kv_cache))
    total = time.perf_counter() - t0
    rec.active = False
    out = {"depth": args.depth, "total_s": total, "import_s": import_s, "params_s": params_s,
           "executables": engine.runner.compile_count,
           "shapes": len(engine.buckets.all_shapes()),
           "jserve": os.path.dirname(jserve.__file__), "jax": jax.__version__}
    out.update(rec.summary())
    return out


# -- child: the issue-31 setup, process start to first token ------------------------------


def child_first_token(args) -> dict:
    from jserve.engine.startup import process_age
    age_at_main = process_age()
    import jax
    rec = EventRecorder()
    from jserve import LLM, SamplingParams
    llm = LLM(args.model_dir, compilation_cache_dir=args.cache_dir, warmup=args.warmup)
    out = llm.generate([list(range(1, 9))], SamplingParams(temperature=0.0, max_tokens=4,
                                                            ignore_eos=True))[0]
    now, age = time.monotonic(), process_age()
    m = out.metrics
    runner = llm.engine.runner
    result = {"depth": args.depth, "warmup": args.warmup, "age_at_main_s": age_at_main,
              "first_token_s": age - (now - m.first_token_time), "fourth_token_s": age,
              "tokens": out.token_ids, "startup": llm.engine.startup.as_dict(),
              "programs_up_front": runner.compiled_up_front,
              "programs_later_so_far": runner.compiled_later,
              "padded_steps": sum(runner.padded.values()),
              "jserve": os.path.dirname(sys.modules["jserve"].__file__), "jax": jax.__version__}
    result.update(rec.summary())
    return result


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


def run_first_token(args) -> None:
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
            r = spawn(args, "first_token", d,
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


# -- child: trace + lower only (what a warm start redoes before its cache reads) ----------


class _StopBeforeCompile(Exception):
    pass


def child_lower_all(args) -> dict:
    """Every bucket shape through the runner's own path, stopped right before the backend
    compile (``Lowered.compile`` raises): the tracing and lowering a warm start still does,
    without needing a filled cache."""
    import jax
    rec, cfg, engine = _uncached_engine(args)
    shapes = engine.buckets.all_shapes()

    def refuse(self, *a, **k):
        raise _StopBeforeCompile

    jax.stages.Lowered.compile = refuse
    rec.reset()
    t0 = time.perf_counter()
    lowered = 0
    for shape in shapes:
        try:
            engine.runner.compiled(shape)
        except _StopBeforeCompile:
            lowered += 1
    total = time.perf_counter() - t0
    s = rec.summary()
    return {"depth": args.depth, "shapes": len(shapes), "lowered": lowered, "total_s": total,
            "trace_s": s["trace_s"], "lower_s": s["lower_s"],
            "n_traces": s["n_traces"], "n_lowerings": s["n_lowerings"]}


# -- child: components -------------------------------------------------------------------


def _abstract(tree):
    import jax
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def aot(fn, *args, static=None, **kwargs) -> dict:
    """Times jit(fn).trace(*args) / .lower() / .compile() on abstract args."""
    import jax
    jitted = jax.jit(fn, **(static or {}))
    t0 = time.perf_counter()
    traced = jitted.trace(*args, **kwargs)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "total_s": t3 - t0}


def parse_shape(s: str) -> tuple[int, int]:
    d, p = s.lower().split("x")
    return int(d), int(p)


def _uncached_engine(args):
    """(event recorder, config, engine built without warm-up or persistent cache)."""
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    rec = EventRecorder()
    from jserve.engine.config import EngineConfig
    from jserve.engine.engine import LLMEngine
    from jserve.model.weights import init_params
    cfg = make_cfg(args.depth, args.hidden, args.vocab)
    extra = {} if args.num_kv_pages is None else {"num_kv_pages": args.num_kv_pages}
    engine = LLMEngine(cfg, init_params(cfg), None,
                       EngineConfig(compilation_cache_dir=None, warmup=False, **extra))
    return rec, cfg, engine


def child_components(args) -> dict:
    import jax.numpy as jnp
    rec, cfg, engine = _uncached_engine(args)
    runner = engine.runner
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    results: dict[str, dict] = {}

    def run(name: str, shape, thunk):
        key = f"{name}@{shape[0]}x{shape[1]}"
        try:
            results[key] = thunk()
        except Exception as e:  # noqa: BLE001 - a refactor may change any signature
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            results[key] = {"error": msg}
            if args.verbose:
                traceback.print_exc()

    jobs = []
    for shape in shapes:
        jobs.append(("fused_step", shape, lambda shape=shape: fused_step(runner, rec, shape)))
        jobs.append(("decoder_layers", shape,
                     lambda shape=shape: decoder_layers(runner, cfg, shape)))
        if args.shared:
            jobs.append(("attention", shape,
                         lambda shape=shape: attention_only(runner, cfg, shape)))
            jobs.append(("sampling_sort", shape, lambda shape=shape: sampling(runner, cfg, shape)))
            jobs.append(("penalties", shape, lambda shape=shape: penalties(runner, cfg, shape)))
            jobs.append(("logprobs", shape, lambda shape=shape: logprobs(runner, cfg, shape)))
    from tqdm import tqdm
    for name, shape, thunk in tqdm(jobs, desc=f"components depth {args.depth}", file=sys.stderr,
                                   leave=False):
        run(name, shape, thunk)
    del jnp
    return {"depth": args.depth, "components": results}


def fused_step(runner, rec: EventRecorder, shape) -> dict:
    """The engine's own path: ``runner.compiled(shape)``; the split comes from JAX's events
    (whatever executables that path compiles, e.g. a separate sampling program)."""
    import jax
    if hasattr(runner, "_compiled"):
        runner._compiled.pop(tuple(shape), None)
    rec.reset()
    before = runner.compile_count
    t0 = time.perf_counter()
    runner.compiled(tuple(shape))
    total = time.perf_counter() - t0
    s = rec.summary()
    del jax
    return {"trace_s": s["trace_s"], "lower_s": s["lower_s"],
            "compile_s": s["backend_compile_s"], "total_s": total,
            "executables": runner.compile_count - before,
            "backend_compiles": s["n_backend_compiles"]}


def decoder_layers(runner, cfg, shape) -> dict:
    """``llama.forward`` (embed, every decoder layer, final norm and LM head) without the
    sampling tail, on the runner's params / KV cache layout."""
    from jserve.model.llama import forward
    spec = runner.arrays_spec(*shape)

    def f(params, kv_cache, batch):
        logits, kv_cache, _ = forward(params, kv_cache, batch, cfg=cfg,
                                      attention_impl=runner.attention_impl)
        return logits, kv_cache
    return aot(f, _abstract(runner.params), _abstract(runner.kv_cache), spec.batch)


def _one_layer_pages(runner):
    """One layer's K and V pages [Hkv, P, S, D] (per-layer list or stacked cache)."""
    import jax
    kv = runner.kv_cache
    if isinstance(kv, (list, tuple)) and isinstance(kv[0], (list, tuple)):
        k, v = kv[0]
    else:
        k, v = kv
        if k.ndim == 5:
            k, v = k[0], v[0]
    return jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)


def attention_only(runner, cfg, shape) -> dict:
    import jax

    from jserve.kernels import attention
    spec = runner.arrays_spec(*shape)
    t = spec.batch.tokens.shape[0]
    q = jax.ShapeDtypeStruct((t, cfg.num_attention_heads, cfg.head_dim), cfg.np_dtype)
    k, v = _one_layer_pages(runner)

    def f(q, k, v, meta):
        return attention(q, k, v, meta, impl="reference")
    return aot(f, q, k, v, spec.batch.attn)


def _logits_spec(cfg, s):
    import jax
    import jax.numpy as jnp
    return jax.ShapeDtypeStruct((s, cfg.vocab_size), jnp.float32)


def sampling(runner, cfg, shape) -> dict:
    """Top-k / top-p / min-p with the full-vocabulary sort, S rows x vocab."""
    from jserve.sampling.sampler import choose_tokens
    spec = runner.arrays_spec(*shape)
    s = spec.sampling.temperature.shape[0]

    def f(logits, sb):
        return choose_tokens(logits, sb, all_greedy=False)
    return aot(f, _logits_spec(cfg, s), spec.sampling)


def penalties(runner, cfg, shape) -> dict:
    """``apply_penalties`` on the rows' state plus the state update (``runner._update_state``)."""
    import jax
    import jax.numpy as jnp

    from jserve.engine import runner as runner_mod
    from jserve.sampling.sampler import apply_penalties
    spec = runner.arrays_spec(*shape)
    s = spec.sampling.temperature.shape[0]
    state = _abstract(runner.state)

    def f(logits, state, arrays):
        state = runner_mod._update_state(state, arrays.batch.tokens, arrays.token_state_rows,
                                         arrays.token_is_prompt, arrays.reset_rows)
        out = apply_penalties(logits, state.output_counts[arrays.state_rows],
                              state.prompt_mask[arrays.state_rows], arrays.sampling)
        return out, state
    del jnp, jax
    return aot(f, _logits_spec(cfg, s), state, spec)


def logprobs(runner, cfg, shape) -> dict:
    import jax
    import jax.numpy as jnp

    from jserve.sampling.params import MAX_LOGPROBS
    from jserve.sampling.sampler import token_logprobs
    spec = runner.arrays_spec(*shape)
    s = spec.sampling.temperature.shape[0]
    tokens = jax.ShapeDtypeStruct((s,), jnp.int32)

    def f(logits, tokens):
        return token_logprobs(logits, tokens, MAX_LOGPROBS)
    return aot(f, _logits_spec(cfg, s), tokens)


# -- parent ------------------------------------------------------------------------------


def spawn(args, mode: str, depth: int, extra: list[str], timeout: float | None) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", mode, "--_depth", str(depth),
           "--_result", path, "--hidden", str(args.hidden), "--vocab", str(args.vocab),
           "--shapes", args.shapes] + extra
    if args.num_kv_pages is not None:
        cmd += ["--num-kv-pages", str(args.num_kv_pages)]
    if args.verbose:
        cmd.append("--verbose")
    # The children import the jserve of this script's checkout unless PYTHONPATH names one.
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--setup", choices=["first-token", "engine"], default="first-token",
                   help="first-token: process start to first token of LLM(<HF dir>) (issue "
                        "31); engine: LLMEngine start and per-component compiles (older study)")
    p.add_argument("--warmup", default="core", choices=["core", "background", "all", "none"],
                   help="first-token setup: the engine's warmup mode")
    p.add_argument("--depths", default="4,32", help="decoder layer counts, comma separated")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--reps", type=int, default=3, help="warm starts per depth (median reported)")
    p.add_argument("--skip-cold", action="store_true",
                   help="no cold start (warm starts then compile into a fresh cache first, "
                        "untimed)")
    p.add_argument("--cold-depths", default=None,
                   help="depths that get a timed cold start (default: all of --depths); the "
                        "others fill their cache untimed before the warm starts")
    p.add_argument("--start-depths", default=None,
                   help="depths that get engine starts (default: all of --depths); the others "
                        "get the trace+lower of every bucket shape only (what a warm start "
                        "redoes), no backend compile")
    p.add_argument("--components-only", action="store_true", help="only the component breakdown")
    p.add_argument("--skip-components", action="store_true", help="no component breakdown")
    p.add_argument("--shapes", default="32x0,0x256,8x128",
                   help="bucket shapes (decodes x prefill tokens) of the component breakdown: "
                        "the engine's largest decode and prefill shapes and a mixed one")
    p.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pool pages (default: the engine's own sizing)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("--verbose", action="store_true", help="tracebacks of failing components")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_depth", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_cache-dir", dest="cache_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_shared", dest="shared", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_model-dir", dest="model_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args._child:
        args.depth = args._depth
        out = {"start": child_start, "lower_all": child_lower_all,
               "components": child_components,
               "first_token": child_first_token}[args._child](args)
        with open(args._result, "w") as f:
            json.dump(out, f)
        return
    if args.setup == "first-token":
        run_first_token(args)
        return

    from tqdm import tqdm
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
    cache_dirs = {d: tempfile.mkdtemp(prefix=f"jserve_startup_cache_d{d}_") for d in depths}
    try:
        bar = tqdm(jobs, desc="bench_startup")
        for kind, d in bar:
            bar.set_postfix_str(f"{kind} depth {d} load {os.getloadavg()[0]:.1f}")
            if kind == "lower_all":
                r = spawn(args, "lower_all", d, [], args.timeout)
                report["lower_only"][d] = r
                tqdm.write(f"trace+lower only, depth {d}: " + (r["error"] if "error" in r else
                           f"{r['lowered']} shapes in {r['total_s']:.1f}s (trace "
                           f"{r['trace_s']:.1f}s, lower {r['lower_s']:.1f}s)"))
                continue
            if kind == "components":
                extra = ["--_shared"] if d == depths[0] else []
                r = spawn(args, "components", d, extra, args.timeout)
                report["components"][d] = r
                bad = {k: v["error"] for k, v in r.get("components", {}).items() if "error" in v}
                if "error" in r or bad:
                    tqdm.write(f"components depth {d}: {r.get('error') or bad}")
                continue
            r = spawn(args, "start", d, ["--_cache-dir", cache_dirs[d]], args.timeout)
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
    for d in sorted(start_depths & set(depths)):
        good = [w for w in starts[d]["warm"] if "error" not in w]
        if good:
            med = statistics.median(w["total_s"] for w in good)
            starts[d]["warm_median"] = min(good, key=lambda w: abs(w["total_s"] - med))
            starts[d]["warm_median"] = {**starts[d]["warm_median"], "total_s": med}
        report["starts"].append(starts[d])
    report["load_end"] = load()
    print(f"load at end: {report['load_end']}")
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


if __name__ == "__main__":
    main()

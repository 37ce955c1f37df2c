"""The child processes of the start-up benchmark (``scripts/bench_startup.py``): each one
engine start, measured from inside a fresh process and returned as a dict (the parent writes
it as JSON): an ``LLMEngine`` start with every bucket compiled, process start to first token
of ``LLM(<HF dir>)``, or the trace and lowering of every bucket shape without a compile."""
from __future__ import annotations

import os
import sys
import time

from harness.jax_events import EventRecorder


def make_cfg(depth: int, hidden: int, vocab: int):
    from jserve.config import ModelConfig
    inter = 688 if hidden == 256 else int(hidden * 8 / 3 + 63) // 64 * 64
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=depth, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=8192, eos_token_ids=(2,))


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
           "executables": engine.runner.programs.compile_count,
           "shapes": len(engine.buckets.all_shapes()),
           "jserve": os.path.dirname(jserve.__file__), "jax": jax.__version__}
    out.update(rec.summary())
    return out


def child_first_token(args) -> dict:
    from jserve.engine.build.startup import process_age
    age_at_main = process_age()
    import jax
    rec = EventRecorder()
    from jserve import LLM, SamplingParams
    llm = LLM(args.model_dir, compilation_cache_dir=args.cache_dir, warmup=args.warmup)
    out = llm.generate([list(range(1, 9))], SamplingParams(temperature=0.0, max_tokens=4,
                                                            ignore_eos=True))[0]
    now, age = time.monotonic(), process_age()
    m = out.metrics
    runner = llm.engine.runner.programs
    result = {"depth": args.depth, "warmup": args.warmup, "age_at_main_s": age_at_main,
              "first_token_s": age - (now - m.first_token_time), "fourth_token_s": age,
              "tokens": out.token_ids, "startup": llm.engine.startup.as_dict(),
              "programs_up_front": runner.compiled_up_front,
              "programs_later_so_far": runner.compiled_later,
              "padded_steps": sum(runner.padded.values()),
              "jserve": os.path.dirname(sys.modules["jserve"].__file__), "jax": jax.__version__}
    result.update(rec.summary())
    return result


class _StopBeforeCompile(Exception):
    pass


def child_lower_all(args) -> dict:
    """Every bucket shape through the runner's own path, stopped right before the backend
    compile (``Lowered.compile`` raises): the tracing and lowering a warm start still does,
    without needing a filled cache."""
    import jax
    rec, cfg, engine = uncached_engine(args)
    shapes = engine.buckets.all_shapes()

    def refuse(self, *a, **k):
        raise _StopBeforeCompile

    jax.stages.Lowered.compile = refuse
    rec.reset()
    t0 = time.perf_counter()
    lowered = 0
    for shape in shapes:
        try:
            engine.runner.programs.compiled(shape)
        except _StopBeforeCompile:
            lowered += 1
    total = time.perf_counter() - t0
    s = rec.summary()
    return {"depth": args.depth, "shapes": len(shapes), "lowered": lowered, "total_s": total,
            "trace_s": s["trace_s"], "lower_s": s["lower_s"],
            "n_traces": s["n_traces"], "n_lowerings": s["n_lowerings"]}


def uncached_engine(args):
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

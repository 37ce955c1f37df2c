"""The start-up benchmark's component breakdown: AOT trace / lower / compile times, on
abstract inputs, of the engine's fused step and of its parts (the decoder layers, attention,
sampling, penalties, log-probs) at given bucket shapes (decodes x prefill tokens)."""
from __future__ import annotations

import sys
import time
import traceback

from harness.jax_events import EventRecorder
from harness.startup_children import uncached_engine


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


def child_components(args) -> dict:
    import jax.numpy as jnp
    rec, cfg, engine = uncached_engine(args)
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
    """The engine's own path: ``runner.programs.compiled(shape)``; the split comes from JAX's
    events (whatever executables that path compiles, e.g. a separate sampling program)."""
    import jax
    programs = runner.programs
    programs.steps.pop(tuple(shape), None)
    rec.reset()
    before = programs.compile_count
    t0 = time.perf_counter()
    programs.compiled(tuple(shape))
    total = time.perf_counter() - t0
    s = rec.summary()
    del jax
    return {"trace_s": s["trace_s"], "lower_s": s["lower_s"],
            "compile_s": s["backend_compile_s"], "total_s": total,
            "executables": programs.compile_count - before,
            "backend_compiles": s["n_backend_compiles"]}


def decoder_layers(runner, cfg, shape) -> dict:
    """``decoder.forward`` (embed, every decoder layer, final norm and LM head) without the
    sampling tail, on the runner's params / KV cache layout."""
    from jserve.model.decoder import forward
    spec = runner.programs.lowering.arrays_spec(*shape)

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
    spec = runner.programs.lowering.arrays_spec(*shape)
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
    spec = runner.programs.lowering.arrays_spec(*shape)
    s = spec.sampling.temperature.shape[0]

    def f(logits, sb):
        return choose_tokens(logits, sb, all_greedy=False)
    return aot(f, _logits_spec(cfg, s), spec.sampling)


def penalties(runner, cfg, shape) -> dict:
    """``apply_penalties`` on the rows' state plus the state update
    (``step_program._update_state``)."""
    import jax
    import jax.numpy as jnp

    from jserve.engine.programs import step_program as runner_mod
    from jserve.sampling.sampler import apply_penalties
    spec = runner.programs.lowering.arrays_spec(*shape)
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
    spec = runner.programs.lowering.arrays_spec(*shape)
    s = spec.sampling.temperature.shape[0]
    tokens = jax.ShapeDtypeStruct((s,), jnp.int32)

    def f(logits, tokens):
        return token_logprobs(logits, tokens, MAX_LOGPROBS)
    return aot(f, _logits_spec(cfg, s), tokens)

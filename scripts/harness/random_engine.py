"""Engines on random weights, for timings and checks that need no real checkpoint: weights
drawn on the device at any size, an engine without prefix cache or warm-up, and a workload
served to completion with its step log."""
from __future__ import annotations

import dataclasses
import functools
import gc

import jax
import jax.numpy as jnp
from tqdm import tqdm

from jserve.config import ModelConfig
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.model.params import param_shapes
from jserve.model.weights import init_params
from jserve.sampling.params import SamplingParams


def free_memory() -> None:
    gc.collect()
    jax.clear_caches()


def random_params(cfg: ModelConfig, seed: int):
    """Random weights like ``init_params`` (normal(0, 0.02) matrices, unit norms) drawn on the
    device: numpy draws for an 8B model take minutes. ``param_shapes`` gives the layout; a
    tiny ``init_params`` of the same depth confirms it still is ``init_params``'s layout
    (else ``init_params`` itself is used, slow but right)."""
    tiny = dataclasses.replace(cfg, vocab_size=16, hidden_size=8, intermediate_size=8,
                               num_attention_heads=cfg.num_key_value_heads, head_dim=2)
    want = init_params(tiny, seed)
    shapes = param_shapes(tiny)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    same = (jax.tree.structure(want) == jax.tree.structure(shapes, is_leaf=is_shape) and
            all(w.shape == s for w, s in zip(jax.tree.leaves(want),
                                             jax.tree.leaves(shapes, is_leaf=is_shape))))
    if not same:
        return init_params(cfg, seed)
    ones = [bool(jnp.all(w == 1)) for w in jax.tree.leaves(want)]
    leaves, treedef = jax.tree.flatten(param_shapes(cfg), is_leaf=is_shape)
    dtype = cfg.np_dtype
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    @functools.partial(jax.jit, static_argnames="shape")
    def normal(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    out = [jnp.ones(s, dtype) if one else normal(k, shape=s)
           for s, one, k in zip(leaves, ones, keys)]
    return jax.tree.unflatten(treedef, out)


def make_engine(cfg, params, impl: str, **kwargs) -> LLMEngine:
    """No warm-up unless ``kwargs`` ask for one (``warmup="all"``: the whole program set,
    compiled in parallel)."""
    # No prefix cache: ``twice`` serves the same prompts again, and a timed run that finds
    # them cached measures one short chunk (and its compile), not the prefill. No decode
    # bursts but those a timing asks for (``bursts.steps``, up to the ``decode_burst`` the
    # programs are built for, "auto" unless ``kwargs`` say).
    engine = LLMEngine(cfg, params, None, EngineConfig(
        attention_impl=impl, enable_prefix_caching=False, **{"warmup": False, **kwargs}))
    engine.bursts.steps = 1
    return engine


def serve(engine: LLMEngine, prompts, params, desc: str):
    """Runs prompts to completion like ``LLM.generate`` (``params``: one SamplingParams or
    one per prompt); returns (outputs in prompt order, step log [(plan, seconds)], compiles
    during the run). Failed requests raise."""
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = engine.add_requests(prompts, params)
    engine.step_log = []
    compiles = engine.compile_count
    done = {}
    with tqdm(total=sum(x.max_tokens for x in params), desc=desc, unit="tok", leave=False,
              disable=None) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(len(out.token_ids))
    outs = [done[i] for i in ids]
    bad = [o for o in outs if o.error or o.finish_reason == "abort"]
    if bad:
        raise RuntimeError(f"{desc}: request {bad[0].request_id} failed: {bad[0].error}")
    log, engine.step_log = engine.step_log, None
    return outs, log, engine.compile_count - compiles


def twice(engine, prompts, params, desc):
    """Serve once untimed (compiles every shape the workload meets), then once timed."""
    serve(engine, prompts, params, f"{desc} (warm-up)")
    return serve(engine, prompts, params, desc)

"""``jserve profile``: time the live engine over a grid of batches and fit the runtime
predictor the deadline-aware scheduler packs with.

Grid: decode batches of several sizes at several context lengths, and prompts long enough to
be cut into budget-sized prefill chunks at growing KV offsets (chunk x KV). Every step's
(plan, device time) is recorded; one step in five is held out to report the error.
"""
from __future__ import annotations

import numpy as np

from jserve.engine.engine import LLMEngine
from jserve.engine.loop.timing import predictor_key
from jserve.sampling.params import SamplingParams
from jserve.scheduler.predictor import LinearPredictor
from sharding.mesh import MeshConfig

LONG_GRID_TOKENS = 16_384     # the longest context profiled (when max_model_len allows)
DECODE_GRID_TOKENS = 65_536   # the most context one decode grid point holds


def profile_samples(engine: LLMEngine, *, seed: int = 0, repeats: int = 2
                    ) -> list[tuple[object, float]]:
    """Runs the grid and returns (plan, seconds) for every step after the first (warm) pass.
    Steps run synchronously here, so each one's time is its own."""
    was_async, engine.async_scheduling = engine.async_scheduling, False
    try:
        return _profile_grid(engine, seed, repeats)
    finally:
        engine.async_scheduling = was_async


def _profile_grid(engine: LLMEngine, seed: int, repeats: int) -> list[tuple[object, float]]:
    rng = np.random.default_rng(seed)
    vocab = min(engine.model_config.vocab_size, 256)
    max_len = engine.max_model_len
    budget = engine.scheduler.token_budget
    max_seqs = engine.config.max_num_seqs
    batches = sorted({1, max(1, max_seqs // 4), max_seqs})
    contexts = [c for c in (16, 128, 512, 2048, 8192, LONG_GRID_TOKENS) if c + 16 < max_len]
    # Decode batches of up to DECODE_GRID_TOKENS context in all, and one prompt of up to
    # LONG_GRID_TOKENS, so chunk x KV is measured where long prefills run, not extrapolated.
    decode_points = [(b, c) for b in batches for c in contexts if b * c <= DECODE_GRID_TOKENS]
    long_prompts = sorted({min(max_len - 16, m * budget) for m in (2, 8)}
                          | {min(max_len - 16, LONG_GRID_TOKENS)})
    samples: list[tuple[object, float]] = []
    for rep in range(repeats + 1):
        engine.step_log = []
        for batch, ctx in decode_points:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            for _ in range(batch):
                engine.add_request(rng.integers(0, vocab, ctx).tolist(), params)
            while engine.has_unfinished():
                engine.step()
        for n in long_prompts:
            engine.add_request(rng.integers(0, vocab, n).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        if rep:  # the first pass compiles and warms caches
            samples.extend(engine.step_log)
    engine.step_log = None
    return samples


def fit_predictor(engine: LLMEngine, samples) -> tuple[LinearPredictor, dict]:
    held = samples[::5]
    train = [s for i, s in enumerate(samples) if i % 5]
    key = predictor_key(engine.model_config, MeshConfig.parse(engine.config.mesh).key())
    predictor = LinearPredictor.fit(train, meta={"key": key,
                                                 "samples": len(train),
                                                 "max_context": profiled_context(samples)},
                                     window=engine.model_config.kv_window)
    err = predictor.relative_errors(held)
    report = {"train_steps": len(train), "held_out_steps": len(held),
              "held_out_median_rel_error": float(np.median(err)),
              "held_out_p90_rel_error": float(np.quantile(err, 0.9))}
    return predictor, report


def profiled_context(samples) -> int:
    """The longest context any timed step touched: how far the fit is measured, not
    extrapolated."""
    return max(max((c.start + c.num_tokens for c in plan.decodes + plan.prefills), default=0)
               for plan, _ in samples)

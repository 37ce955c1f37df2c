"""``jserve profile`` on the live engine: the grid covers chunk x KV and decode batch x KV, and
the fitted predictor is saved where the engine will look for it."""
from __future__ import annotations

import pytest

from jserve.engine.loop.profiler import fit_predictor, profile_samples
from jserve.engine.loop.timing import default_predictor_path
from jserve.scheduler.predictor import LinearPredictor
from llm_helpers import small_llm

pytestmark = pytest.mark.slow


def test_profile_grid_and_fit(tmp_path):
    engine = small_llm(max_model_len=512).engine
    samples = profile_samples(engine, repeats=1)
    decode_batches = {len(p.decodes) for p, _ in samples if not p.prefills}
    chunk_offsets = {c.start for p, _ in samples for c in p.prefills}
    assert {1, 4} <= decode_batches
    assert len(chunk_offsets) >= 4 and max(chunk_offsets) >= 64  # chunks at growing KV
    assert all(t > 0 for _, t in samples)
    predictor, report = fit_predictor(engine, samples)
    assert report["held_out_steps"] == len(samples[::5])
    assert all(c >= 0 for c in predictor.coef)
    # The grid reaches the longest context the engine holds; the fit says how far it measured.
    assert predictor.meta["max_context"] == max(
        c.start + c.num_tokens for p, _ in samples for c in p.decodes + p.prefills) >= 496
    default = default_predictor_path(engine.model_config, engine.config)
    assert default.parent.name == "predictors" and default.name.endswith("-cpu-mesh1.json")
    path = tmp_path / default.name
    predictor.save(path)
    assert LinearPredictor.load(path) == predictor
    assert engine.step_log is None and engine.allocator.num_allocated == 0

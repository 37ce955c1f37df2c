"""Runtime predictors: ``predict(plan) -> seconds`` for any BatchPlan.

The packer knows nothing else about hardware. ``LinearPredictor`` is the live engine's model,
fitted by least squares to timed steps (``jserve profile``); ``jserve.sim.hardware`` has the
profile-driven GPU model the simulator uses. No JAX here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
from scipy.optimize import nnls

from jserve.scheduler.plan import BatchPlan


class RuntimePredictor(Protocol):
    def predict(self, plan: BatchPlan) -> float: ...


FEATURES = ("constant", "tokens", "decodes", "decode_context", "prefill_attention",
            "prefill_seqs")


def plan_features(plan: BatchPlan) -> np.ndarray:
    """The terms a step's time is linear in: a constant, tokens (matmuls), decode rows and
    their context (KV reads), chunk x context of prefills (attention), prefill rows."""
    decode_ctx = sum(c.start + 1 for c in plan.decodes)
    attention = sum(c.num_tokens * (c.start + c.num_tokens) for c in plan.prefills)
    return np.array([1.0, plan.num_tokens, len(plan.decodes), decode_ctx, attention,
                     len(plan.prefills)], np.float64)


@dataclasses.dataclass(frozen=True)
class LinearPredictor:
    """seconds = coef . plan_features(plan); coefficients are non-negative, so predicted time
    grows with every term (the chunk-size binary search relies on that)."""

    coef: tuple[float, ...]
    meta: dict = dataclasses.field(default_factory=dict, compare=False)

    def predict(self, plan: BatchPlan) -> float:
        if plan.is_empty:
            return 0.0
        return float(plan_features(plan) @ np.asarray(self.coef))

    @classmethod
    def fit(cls, samples: Sequence[tuple[BatchPlan, float]], meta: dict | None = None
            ) -> "LinearPredictor":
        """Non-negative least squares on relative error (rows scaled by 1 / time), so short
        decode steps count as much as long prefills."""
        if len(samples) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} timed steps, got {len(samples)}")
        x = np.stack([plan_features(p) for p, _ in samples])
        y = np.array([t for _, t in samples], np.float64)
        if np.any(y <= 0):
            raise ValueError("step times must be positive")
        coef, _ = nnls(x / y[:, None], np.ones_like(y))
        return cls(tuple(float(c) for c in coef), dict(meta or {}))

    def relative_errors(self, samples: Sequence[tuple[BatchPlan, float]]) -> np.ndarray:
        return np.array([abs(self.predict(p) - t) / t for p, t in samples])

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(
            {"features": FEATURES, "coef": self.coef, "meta": self.meta}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LinearPredictor":
        d = json.loads(Path(path).read_text())
        if tuple(d["features"]) != FEATURES:
            raise ValueError(f"{path} was fitted on features {d['features']}, expected {FEATURES}")
        return cls(tuple(d["coef"]), d.get("meta", {}))

"""Runtime predictors: ``predict(plan) -> seconds`` for any BatchPlan.

The packer knows nothing else about hardware. ``LinearPredictor`` is the live engine's model,
fitted by least squares to timed steps (``jserve profile``); ``jserve.sim.hardware`` has the
profile-driven GPU model the simulator uses. No JAX here.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from jserve.scheduler.plan import BatchPlan, ScheduledChunk, with_chunk


class RuntimePredictor(Protocol):
    def predict(self, plan: BatchPlan) -> float: ...


# Optionally a predictor also has ``chunk_timer(plan) -> ChunkTimer``: the time of ``plan``
# plus one more prefill chunk, in O(1) per call, so the chunk-size search does not rebuild and
# re-walk a batch of a hundred decodes for every chunk size it tries
# (``chunk_timer`` falls back to ``predict`` without it).
ChunkTimer = Callable[[str, int, int, bool], float]  # (request_id, start, num_tokens, samples)


def chunk_timer(predictor: RuntimePredictor, plan: BatchPlan) -> ChunkTimer:
    """predict(plan + one prefill chunk) as a function of the chunk: the predictor's own O(1)
    ``chunk_timer`` when it has one, else ``predict`` on the extended plan."""
    fast = getattr(predictor, "chunk_timer", None)
    if fast is not None:
        return fast(plan)

    def time(request_id: str, start: int, n: int, samples: bool) -> float:
        return predictor.predict(with_chunk(plan, request_id, start, n, samples))
    return time


FEATURES = ("constant", "tokens", "decodes", "decode_context", "prefill_attention",
            "prefill_seqs")


def _decode_context(decodes: tuple[ScheduledChunk, ...], window: int | None = None) -> int:
    """KV read by the decode rows: a speculating decode's row j reads start + j + 1, at most
    ``window`` keys (a sliding window's kernels skip the pages before it)."""
    if window is not None:
        return sum(min(c.start + j + 1, window) for c in decodes for j in range(c.num_tokens))
    return sum(c.start + 1 if c.num_tokens == 1 else
               c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2
               for c in decodes)


def _chunk_attention(start: int, n: int, window: int | None) -> int:
    """Chunk x context of a prefill chunk, its context at most ``window`` keys."""
    return n * (start + n if window is None else min(start + n, window))


def _terms(plan: BatchPlan, decode_ctx: int, window: int | None = None
           ) -> tuple[int, int, int, int, int]:
    """The features after the constant, as exact integers."""
    attention = sum(_chunk_attention(c.start, c.num_tokens, window) for c in plan.prefills)
    return plan.num_tokens, plan.num_decode_rows, decode_ctx, attention, len(plan.prefills)


def plan_features(plan: BatchPlan, window: int | None = None) -> np.ndarray:
    """The terms a step's time is linear in: a constant, tokens (matmuls), decode rows and
    their context (KV reads), chunk x context of prefills (attention), prefill rows. With a
    sliding ``window`` (the model's ``kv_window``) a query reads at most that many keys."""
    return np.array([1.0, *_terms(plan, _decode_context(plan.decodes, window), window)],
                    np.float64)


@dataclasses.dataclass(frozen=True)
class LinearPredictor:
    """seconds = coef . plan_features(plan); coefficients are non-negative, so predicted time
    grows with every term (the chunk-size binary search relies on that)."""

    coef: tuple[float, ...]
    meta: dict = dataclasses.field(default_factory=dict, compare=False)
    window: int | None = None  # the model's sliding window (``plan_features``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "coef", tuple(float(c) for c in self.coef))
        # The decode context of the last decode tuple seen: the scheduler prices many
        # prefill chunks beside one set of decodes.
        object.__setattr__(self, "_last_decodes", ((), 0))

    def predict(self, plan: BatchPlan) -> float:
        if plan.is_empty:
            return 0.0
        return self._seconds(*self._terms(plan))

    def chunk_timer(self, plan: BatchPlan) -> ChunkTimer:
        """predict(plan + one prefill chunk) from the plan's features summed once: exactly
        ``predict``'s arithmetic (integer features, one order of summation)."""
        tokens, decodes, decode_ctx, attention, prefills = self._terms(plan)
        seconds, window = self._seconds, self.window

        def time(request_id: str, start: int, n: int, samples: bool) -> float:
            return seconds(tokens + n, decodes, decode_ctx,
                           attention + _chunk_attention(start, n, window), prefills + 1)
        return time

    def _terms(self, plan: BatchPlan) -> tuple[int, int, int, int, int]:
        decodes, decode_ctx = self._last_decodes
        if plan.decodes is not decodes:
            decode_ctx = _decode_context(plan.decodes, self.window)
            object.__setattr__(self, "_last_decodes", (plan.decodes, decode_ctx))
        return _terms(plan, decode_ctx, self.window)

    def _seconds(self, tokens: int, decodes: int, decode_ctx: int, attention: int,
                 prefills: int) -> float:
        """coef . features in plain Python: for six terms much faster than a numpy dot."""
        c = self.coef
        return (c[0] + c[1] * tokens + c[2] * decodes + c[3] * decode_ctx + c[4] * attention
                + c[5] * prefills)

    @classmethod
    def fit(cls, samples: Sequence[tuple[BatchPlan, float]], meta: dict | None = None,
            window: int | None = None) -> "LinearPredictor":
        """Non-negative least squares on relative error (rows scaled by 1 / time), so short
        decode steps count as much as long prefills; ``window``: the model's sliding
        window, which the features count context by."""
        if len(samples) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} timed steps, got {len(samples)}")
        x = np.stack([plan_features(p, window) for p, _ in samples])
        y = np.array([t for _, t in samples], np.float64)
        if np.any(y <= 0):
            raise ValueError("step times must be positive")
        from scipy.optimize import nnls  # 0.6 s of import: only when fitting a profile

        coef, _ = nnls(x / y[:, None], np.ones_like(y))
        return cls(tuple(float(c) for c in coef), dict(meta or {}), window)

    def relative_errors(self, samples: Sequence[tuple[BatchPlan, float]]) -> np.ndarray:
        return np.array([abs(self.predict(p) - t) / t for p, t in samples])

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(
            {"features": FEATURES, "coef": self.coef, "meta": self.meta,
             **({"window": self.window} if self.window is not None else {})}, indent=2)
            + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LinearPredictor":
        d = json.loads(Path(path).read_text())
        if tuple(d["features"]) != FEATURES:
            raise ValueError(f"{path} was fitted on features {d['features']}, expected {FEATURES}")
        return cls(tuple(d["coef"]), d.get("meta", {}), d.get("window"))


class CorrectedPredictor:
    """A predictor scaled online by what steps really take: ``observe(plan, seconds)`` moves
    ``scale`` toward measured / predicted (an exponential average with weight ``alpha``,
    clamped to [``lo``, ``hi``]). A profile taken on a quiet device, a machine under other
    load or a fallback estimate then still packs iterations that fit the budget. Scaling by
    one positive number keeps the chunk search's monotonicity."""

    def __init__(self, base: RuntimePredictor, alpha: float = 0.1, lo: float = 0.25,
                 hi: float = 8.0):
        self.base, self.alpha, self.lo, self.hi = base, alpha, lo, hi
        self.scale = 1.0
        self.meta = getattr(base, "meta", {})

    def predict(self, plan: BatchPlan) -> float:
        return self.base.predict(plan) * self.scale

    def chunk_timer(self, plan: BatchPlan) -> ChunkTimer:
        timer, scale = chunk_timer(self.base, plan), self.scale
        return lambda request_id, start, n, samples: timer(request_id, start, n,
                                                           samples) * scale

    def observe(self, plan: BatchPlan, seconds: float) -> None:
        predicted = self.base.predict(plan)
        if predicted > 0 and seconds > 0:
            ratio = seconds / predicted
            scale = (1 - self.alpha) * self.scale + self.alpha * ratio
            self.scale = min(self.hi, max(self.lo, scale))

"""Benchmark workloads: ShareGPT4 short requests with Medha-SWE-like long ones mixed in, arrivals
from a Poisson process or replayed from a production trace, lengths scaled so a small machine
keeps the workload's shape. Written in the trace format of ``jserve.sim.trace``.

Medha-SWE is not public: its long requests are synthesized from the published statistics
(``jserve.sim.trace.mix_long_requests``); ``WorkloadSpec.describe()`` says so and is printed
with every result.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from jserve.sim.trace import (
    MEDHA_SWE_PROMPT_RANGE,
    TraceRequest,
    mix_long_requests,
    poisson_arrivals,
    read_lengths,
    read_trace,
)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Short prompts are scaled by ``short_scale``, long ones by ``long_scale`` and every output
    by ``output_scale`` (each rounded, at least ``min_tokens``). Arrivals: Poisson at ``qps``,
    or, with ``arrival_trace``, that trace's ``arrived_at`` (from its first row on) times
    ``time_scale``. Traces are paths or packaged names (``jserve.data.TRACES``)."""

    num_requests: int = 100
    long_fraction: float = 0.05
    qps: float | None = 1.0
    arrival_trace: str | None = None
    time_scale: float = 1.0
    short_scale: float = 1.0
    long_scale: float = 1.0
    output_scale: float = 1.0
    min_tokens: int = 1
    seed: int = 0
    short_trace: str = "sharegpt4"  # where short requests' lengths are drawn from

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        if (self.qps is None) == (self.arrival_trace is None):
            raise ValueError("give exactly one of qps (Poisson) and arrival_trace (replay)")
        for name in ("time_scale", "short_scale", "long_scale", "output_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")

    @property
    def long_prompt_tokens(self) -> int:
        """The shortest possible long prompt after scaling: the short/long split."""
        return max(self.min_tokens, round(MEDHA_SWE_PROMPT_RANGE[0] * self.long_scale))

    def describe(self) -> str:
        arrivals = (f"Poisson {self.qps} req/s" if self.qps is not None else
                    f"{Path(self.arrival_trace).name} x{self.time_scale:g} time")
        return (f"{self.num_requests} requests ({self.long_fraction:.0%} long), {arrivals}, "
                f"seed {self.seed}; lengths scaled: short prompts x{self.short_scale:g}, long "
                f"prompts x{self.long_scale:g} (synthetic Medha-SWE: log-normal on its "
                f"published P50/P90, 128K-1M before scaling), outputs x{self.output_scale:g}, "
                f"min {self.min_tokens} tokens; long = prompt >= {self.long_prompt_tokens}; short "
                f"lengths from {Path(self.short_trace).name}")


def _scaled(n: int, scale: float, floor: int) -> int:
    return max(floor, round(n * scale))


def replayed_arrivals(trace: str | Path, n: int, time_scale: float) -> np.ndarray:
    """The first ``n`` arrival times of a trace, from 0, stretched by ``time_scale``."""
    times = [t.arrival_s for t in read_trace(trace, max_requests=n)]
    if len(times) < n:
        raise ValueError(f"{trace} has {len(times)} arrivals; the workload needs {n}")
    return (np.asarray(times) - times[0]) * time_scale


def build_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    """Requests in arrival order. Raises if scaling would let a short prompt reach the long
    split (the two groups must stay apart for the metrics)."""
    pairs = mix_long_requests(read_lengths(spec.short_trace),
                              spec.num_requests, spec.long_fraction, spec.seed)
    arrivals = (poisson_arrivals(spec.num_requests, spec.qps, spec.seed) if spec.qps is not None
                else replayed_arrivals(spec.arrival_trace, spec.num_requests, spec.time_scale))
    out = []
    for i, ((prompt, output), at) in enumerate(zip(pairs, arrivals)):
        is_long = prompt >= MEDHA_SWE_PROMPT_RANGE[0]
        p = _scaled(prompt, spec.long_scale if is_long else spec.short_scale, spec.min_tokens)
        if not is_long and p >= spec.long_prompt_tokens:
            raise ValueError(f"short prompt of {prompt} tokens scales to {p}, at or past the "
                             f"long split {spec.long_prompt_tokens}: lower short_scale")
        out.append(TraceRequest(str(i), float(at), p, _scaled(output, spec.output_scale, 1)))
    return out


def model_len_for(trace: list[TraceRequest]) -> int:
    """``max_model_len`` for a trace: its longest prompt plus output, rounded up to 4096 so
    traces of similar reach share one set of compiled shapes."""
    longest = max(t.prompt_tokens + t.output_tokens for t in trace)
    return 4096 * math.ceil(longest / 4096)

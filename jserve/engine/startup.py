"""Where a start goes: the phases of building an engine, timed, and the line ``jserve serve``
and ``LLM`` print when the engine is ready ("ready in 3.2 s: imports 0.9, weights 0.4, KV
0.1, programs 1.6 (2 cached, 1 compiled, 16 deferred)").

Weights and KV pages load in a thread while the programs compile (``factory``), so the
phases overlap: each phase's figure is its own wall time, and ``ready`` (process start to
the engine being ready) is less than their sum when they overlapped."""
from __future__ import annotations

import dataclasses
import os
import time


def process_age() -> float | None:
    """Seconds since this process started (Linux), else None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclasses.dataclass
class StartupTimes:
    """Seconds per phase of one engine's start (``None``: not measured)."""

    before_engine: float | None = None  # process start to the engine's construction: imports
    weights: float = 0.0     # reading, laying out and placing the weights
    kv: float = 0.0          # allocating the KV pages and the penalty state
    programs: float = 0.0    # tracing, lowering, compiling or reading the persistent cache
    engine: float = 0.0      # the engine's construction, all phases
    cached: int = 0          # programs read from the persistent compilation cache
    compiled: int = 0        # programs compiled before ready
    deferred: int = 0        # step shapes left to compile later (background or first use)
    overlapped: bool = False  # weights and KV loaded while the programs compiled
    _started: float = dataclasses.field(default_factory=time.perf_counter, repr=False)

    def __post_init__(self) -> None:
        if self.before_engine is None:
            self.before_engine = process_age()

    def done(self) -> None:
        self.engine = time.perf_counter() - self._started

    @property
    def ready(self) -> float:
        """Process start (or, where unknown, the engine's construction) to ready."""
        return (self.before_engine or 0.0) + self.engine

    def line(self) -> str:
        parts = ([] if self.before_engine is None else [f"imports {self.before_engine:.1f}"])
        parts += [f"weights {self.weights:.1f}", f"KV {self.kv:.1f}",
                  f"programs {self.programs:.1f} ({self.cached} cached, {self.compiled} "
                  f"compiled, {self.deferred} deferred)"]
        return (f"ready in {self.ready:.1f} s: " + ", ".join(parts)
                + (" (weights and KV loaded while the programs compiled)" if self.overlapped
                   else ""))

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")} | {
            "ready": self.ready}

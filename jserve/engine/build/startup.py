"""Where a start goes: the phases of building an engine, timed, and the line ``jserve serve``
and ``LLM`` print when the engine is ready: what runs (backend, devices, attention kernel,
layer mode, dtype and why), then the phases and the step programs ("ready in 3.2 s on cpu (1
x cpu), attention cpu, layers unrolled, dtype float32: imports 0.9, weights 0.4, KV 0.1,
programs 1.6 (13 programs: 12 cached, 1 compiled; 2.0 s of compiles over 2 threads)").

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
    compile_seconds: float = 0.0  # lowering + compiling (or cache reads), summed per program
    threads: int = 0         # compile threads
    # What runs (``factory.describe_run``): None where not known.
    backend: str | None = None       # JAX's backend: cpu, gpu, tpu
    devices: str | None = None       # "8 x NVIDIA H100 80GB HBM3": the devices the engine uses
    attention: str | None = None     # the attention kernel ``attention_impl`` resolved to
    layer_mode: str | None = None    # unrolled, sliced or loop (``EngineConfig.layer_mode``)
    dtype: str | None = None         # the model's compute dtype
    dtype_reason: str | None = None  # why that dtype ("auto: bf16 checkpoint, CPU backend")
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

    def run_line(self) -> str:
        """What runs: ", on gpu (1 x NVIDIA H200), attention pallas_gpu, layers sliced, dtype
        bfloat16 (auto: ...)"; empty where nothing is known."""
        parts = []
        if self.backend:
            parts.append(f"on {self.backend}" + (f" ({self.devices})" if self.devices else ""))
        if self.attention:
            parts.append(f"attention {self.attention}")
        if self.layer_mode:
            parts.append(f"layers {self.layer_mode}")
        if self.dtype:
            parts.append(f"dtype {self.dtype}"
                         + (f" ({self.dtype_reason})" if self.dtype_reason else ""))
        return "".join(f", {p}" if i else f" {p}" for i, p in enumerate(parts))

    def line(self) -> str:
        parts = ([] if self.before_engine is None else [f"imports {self.before_engine:.1f}"])
        total = self.cached + self.compiled
        later = f", {self.deferred} deferred" if self.deferred else ""
        parts += [f"weights {self.weights:.1f}", f"KV {self.kv:.1f}",
                  f"programs {self.programs:.1f} ({total} programs: {self.cached} cached, "
                  f"{self.compiled} compiled{later}"
                  + (f"; {self.compile_seconds:.1f} s of compiles over {self.threads} threads"
                     if self.threads else "") + ")"]
        return (f"ready in {self.ready:.1f} s{self.run_line()}: " + ", ".join(parts)
                + (" (weights and KV loaded while the programs compiled)" if self.overlapped
                   else ""))

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")} | {
            "ready": self.ready}

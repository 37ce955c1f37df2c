"""The engine's program set for a target, compiled on its compile-only devices through the
engine's own code (``factory.runner_options``, ``ModelRunner(abstract=True)``,
``StepPrograms.warmup``: the programs the engine would compile there, not copies), each
read by ``hlo.analyse`` and priced by the target's roofline."""
from __future__ import annotations

import dataclasses
import time

import jax

from jserve import backend
from jserve.cache.hybrid import local_window
from jserve.config import ModelConfig
from jserve.engine.build.factory import bursts_allowed, check_config, host_tier_on, runner_options
from jserve.engine.build.memory_plan import CompiledMemory, MemoryPlan, per_device_bytes, plan
from jserve.engine.config import EngineConfig
from jserve.engine.device.runner import ModelRunner
from jserve.engine.programs.abstract import abstract_kv_cache, params_on_mesh, params_on_one_device
from jserve.lora.config import pool_size
from jserve.targets import hlo
from jserve.targets.specs import Target, devices, target
from sharding.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One compiled program: its name ("step 1x0", "sampler 33 rows", ...), the seconds its
    lowering and compile took here, what its optimized HLO does, XLA's memory analysis, and
    the bytes XLA's cost analysis says it accesses (None where the backend has none)."""

    name: str
    seconds: float
    analysis: hlo.Analysis
    memory: CompiledMemory | None
    cost_bytes: float | None
    cost_flops: float | None
    text: str = dataclasses.field(repr=False, default="")  # the optimized HLO

    def roofline_seconds(self, t: Target) -> float:
        """max(bytes / bandwidth, FLOPs / peak) plus the launches outside CUDA graphs, of a
        greedy step (the cheapest branches, where XLA's cost analysis says nothing)."""
        moved = self.cost_bytes if self.cost_bytes is not None else self.analysis.least_bytes
        flops = self.cost_flops if self.cost_flops is not None else self.analysis.flops
        return roofline(moved, flops, self.analysis.launches_outside_graphs, t.bandwidth,
                        t.peak_flops, t.launch_seconds)


def roofline(moved: float, flops: float, launches: int, bandwidth: float, peak_flops: float,
             launch_seconds: float) -> float:
    """A program's floor: its bytes at the bandwidth or its FLOPs at the peak, whichever is
    longer, plus ``launches`` that each cost ``launch_seconds`` more."""
    return max(moved / bandwidth, flops / peak_flops) + launches * launch_seconds


def predict(compiled, cfg: ModelConfig, kv_cache, bandwidth: float | None,
            peak_flops: float | None, kv_read: float = 0.0, params=None) -> dict:
    """What a compiled step should take on the device it was compiled for (the device
    check's prediction beside each timing, of greedy steps): its HLO read (``hlo.analyse``,
    the cheapest branches), ``kv_read`` bytes of KV pages its sequences attend to added
    (the program does not say them); no time where the device's peaks are unknown (a
    CPU)."""
    a = hlo.analyse(compiled.as_text(), hlo.Geometry.of(cfg, kv_cache, params))
    launch = 4e-6 if backend.current() == "gpu" else 0.0
    seconds = None if not (bandwidth and peak_flops) else roofline(
        a.least_bytes + kv_read, a.flops, a.launches_outside_graphs, bandwidth, peak_flops,
        launch)
    return dict(predicted_ms=None if seconds is None else seconds * 1e3,
                launches=a.launches, host_syncs=a.least_host_syncs,
                hlo_gb=a.least_bytes / 1e9, weight_copy_gb=a.copy_bytes("weight") / 1e9,
                kv_copy_gb=a.copy_bytes("kv") / 1e9)


@dataclasses.dataclass
class TargetReport:
    """A configuration's programs compiled for one target, with the plan they were sized by."""

    target: Target
    layer_mode: str
    attention: str
    weight_bytes: int
    kv_pool_bytes: int
    plan: MemoryPlan
    programs: list[ProgramReport]
    seconds: float

    @property
    def largest_memory(self) -> int:
        """The most device memory one program needs (XLA's memory analysis: arguments,
        temporaries and outputs not aliased to an argument)."""
        return max((p.memory.needed_bytes for p in self.programs if p.memory is not None),
                   default=0)

    @property
    def fits(self) -> bool:
        return self.plan.fits and self.largest_memory <= self.target.memory_bytes


def _cost(compiled) -> tuple[float | None, float | None]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends raise rather than return None
        cost = None
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    if not cost:
        return None, None
    return cost.get("bytes accessed"), cost.get("flops")


def _runner(cfg: ModelConfig, config: EngineConfig, geo, t: Target, p: MemoryPlan
            ) -> tuple[ModelRunner, str, bool]:
    """The abstract runner the engine would build on ``t``'s devices (``geo``: the
    engine's ``check_config``), its layer mode and whether it compiles the swap programs."""
    mc = geo.mesh_config
    devs = devices(t.name, mc.size)
    mesh = make_mesh(mc, devs) if mc.size > 1 else None
    mode = config.layer_mode(cfg.num_hidden_layers, mc.spp, t.platform,
                             windowed=local_window(cfg) is not None)
    unroll = mode == "unrolled"
    lora = pool_size(config.lora)
    params = (params_on_one_device(cfg, unroll, devs[0], lora) if mesh is None
              else params_on_mesh(cfg, mesh, unroll, lora))
    kv = abstract_kv_cache(cfg, p.num_kv_pages, config.page_size, mesh, devs[0],
                           config.kv_cache_dtype, p.local_kv_pages)
    bursts = config.burst_steps() if bursts_allowed(config, mc, None) else 1
    runner = ModelRunner(cfg, params, kv, abstract=True,
                         **runner_options(config, geo.buckets, mesh, mode, None, bursts))
    return runner, mode, host_tier_on(config, mc)


def compile_for(name: str, cfg: ModelConfig, config: EngineConfig,
                threads: int | None = None, progress: bool | None = None,
                steps: list[tuple[int, int]] | None = None) -> TargetReport:
    """Every program the engine would compile for ``cfg`` and ``config`` on target
    ``name``, compiled here for it and read; ``steps``: only the step programs of the
    buckets these (decodes, prefill tokens) fall in. The KV pool is the one ``jserve plan``
    sizes for the target's memory (or ``config``'s explicit pool)."""
    from jserve.kernels import resolve_impl

    t = target(name)
    t0 = time.perf_counter()
    with backend.compiling_for(t.platform):
        geo = check_config(cfg, config)
        # The plan compiles the largest step for its activations only when they size the
        # pool (no explicit pool); the programs' own memory analyses say whether it fits.
        explicit = config.num_kv_pages is not None or config.kv_cache_bytes is not None
        p = plan(cfg, config, device_memory_bytes=t.memory_bytes,
                 devices=devices(t.name, geo.mesh_config.size), compile=not explicit)
        if p.num_kv_pages < 2:
            raise ValueError(f"{name}: no room for a KV pool ({p.summary()})")
        runner, mode, swaps = _runner(cfg, config, geo, t, p)
        programs = runner.programs
        programs.swaps = swaps
        try:
            if steps is None:
                programs.warmup(threads=threads, progress=progress)
            else:
                _compile_steps(programs, steps)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise ValueError(f"{name}: does not fit ({str(e).splitlines()[0]}); more "
                             "devices (--mesh tp=N) or a smaller pool") from None
        attention = resolve_impl(config.attention_impl)
    geometry = hlo.Geometry.of(cfg, runner.kv_cache, runner.params)
    reports = []
    for pname, compiled in _compiled(programs):
        cost_bytes, flops = _cost(compiled)
        text = compiled.as_text()
        reports.append(ProgramReport(
            pname, programs.compile_times.get(pname, 0.0), hlo.analyse(text, geometry),
            CompiledMemory.of(compiled), cost_bytes, flops, text))
    return TargetReport(t, mode, attention, per_device_bytes(runner.params),
                        per_device_bytes(runner.kv_cache), p, reports,
                        time.perf_counter() - t0)


def _compile_steps(programs, steps: list[tuple[int, int]]) -> None:
    """The step programs of the buckets ``steps`` fall in, one after another, timed."""
    buckets = programs.lowering.buckets
    for shape in dict.fromkeys(buckets.shape_for(*s) for s in steps):
        t0 = time.perf_counter()
        programs.compiled(shape)
        programs.compile_times[f"step {shape[0]}x{shape[1]}"] = time.perf_counter() - t0


def _compiled(programs) -> list[tuple[str, jax.stages.Compiled]]:
    """(name, executable) of each compiled program, in ``warmup``'s names."""
    out = [(f"step {s[0]}x{s[1]}", exe) for s, (exe, _) in sorted(programs.steps.items())]
    out += [(f"pass {s[0]}x{s[1]}", exe) for s, (exe, _) in sorted(programs.passes.items())]
    out += [(f"sampler {rows} rows", exe) for rows, exe in sorted(programs.samplers.items())]
    return out

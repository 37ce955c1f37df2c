"""Policy name + mesh -> a simulated run: the one place ``jserve simulate`` and the
reproduction script build schedulers, time models and KV pools, so a name means one setup.

Policies: ``fcfs`` (non-preemptive, whole prompts up to the token budget), ``sarathi``
(FCFS chunks of a fixed ``sarathi_chunk`` tokens), ``edf``, ``lrs``, ``lars`` (adaptive
chunks, space sharing off), ``lars-ss`` (LARS with space sharing on: the full Medha policy),
``loongserve`` (LoongServe's global manager, ``jserve.sim.loongserve_manager``, on the same GPUs
cut into TP-``esp_instance_tp`` elastic instances, run by ``jserve.sim.loongserve``).
Deadline policies get TTFT deadlines from ``DeadlineConfig`` (max(1.5 x isolated prefill,
0.5 s)) and the iteration budget t_target = the TPOT SLO.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from jserve.cache.allocator import PageAllocator
from jserve.cache.host_tier import HostTier
from jserve.scheduler import registry
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.chunking import PrefillTimeCache, largest_chunk
from jserve.scheduler.deadline import DeadlineConfig
from jserve.scheduler.plan import BatchPlan, ScheduledChunk
from jserve.scheduler.predictor import RuntimePredictor
from jserve.sim.capacity import esp_work_s, mesh_work_s, saturation_qps
from jserve.sim.esp import EspCosts
from jserve.sim.hardware import GpuTimeModel, StageTimes
from jserve.sim.loongserve import simulate_loongserve
from jserve.sim.simulator import VirtualClock, simulate
from jserve.sim.trace import TraceRequest

_CONTEXT_STEP = 65_536


@dataclasses.dataclass(frozen=True)
class SimConfig:
    model: str = "llama3-8b"
    hardware: str = "a100"
    tp: int = 8
    spp: int = 1
    kvp: int = 1
    iteration_budget: float = 0.05      # seconds; the deadline policies' time per iteration
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 32_768  # the token cap of fcfs iterations
    max_prefill_seqs: int = 8
    sarathi_chunk: int = 512
    page_size: int = 16
    memory_fraction: float = 0.9
    kv_cache_tokens: int | None = None  # the KV pool; None: what memory_fraction leaves
    esp_instance_tp: int = 2            # Medha §6.2 runs LoongServe as TP-2 instances
    horizon_s: float | None = None      # stop the clock here; None: run until all finish
    prefix_caching: bool = False        # the engine's automatic prefix caching (TraceRequest
                                        # prefix ids say which prompts share what)
    # The prefix cache's host tier (prefix caching on): tokens of host memory evicted cached
    # pages go to (0: none), and each GPU's host link (GB/s) a restore crosses: restoring n
    # pages costs n x page x one token's KV per GPU / that, priced by the deadline policies
    # and added to the step that needs them (the simulator does not overlap copies).
    host_tier_tokens: int = 0
    host_gb_per_s: float = 25.0
    # Deadline policies' slack counts the pipeline's last pass (PrefillTimeCache.drain_s), and
    # lars ranks due and late requests first (DeadlineConfig.due_first); False: the behaviour
    # before either (scripts/lars_attainment.py compares them).
    pipeline_drain: bool = True
    due_first: bool = DeadlineConfig.due_first
    quick_first: float = DeadlineConfig.quick_first

    def __post_init__(self) -> None:
        if self.iteration_budget <= 0:
            raise ValueError(f"iteration_budget must be > 0, got {self.iteration_budget}")


@functools.lru_cache(maxsize=8)
def _time_model(model: str, hardware: str, tp: int, spp: int, kvp: int) -> GpuTimeModel:
    return GpuTimeModel(model, hardware, tp=tp, spp=spp, kvp=kvp)


def _prefill_cache(cfg: SimConfig, max_context: int) -> PrefillTimeCache:
    """Isolated prefill times on the pipelined mesh: chunks stream one stage time apart, so
    the times sum stage times, for chunks sized to a stage-time budget of t_target / spp
    (within the embedding and one send of the scheduler's latency-budget chunks)."""
    return _cached_prefill_cache(cfg.model, cfg.hardware, cfg.tp, cfg.spp, cfg.kvp,
                                 cfg.iteration_budget, cfg.max_num_batched_tokens, max_context,
                                 cfg.pipeline_drain)


@functools.lru_cache(maxsize=8)
def _cached_prefill_cache(model: str, hardware: str, tp: int, spp: int, kvp: int,
                          budget: float, max_chunk: int, max_context: int,
                          drain: bool = True) -> PrefillTimeCache:
    """Keyed on what the table depends on, so runs differing in anything else share it."""
    time_model = _time_model(model, hardware, tp, spp, kvp)
    return PrefillTimeCache(StageTimes(time_model), max_context, budget / spp,
                            chunk_granularity=DeadlineConfig.chunk_granularity,
                            max_chunk=max_chunk,
                            drain_s=pipeline_drain(time_model, budget) if drain else 0.0)


def pipeline_drain(model: GpuTimeModel, t_target: float) -> float:
    """How much later than its issue interval a batch's sampled token comes out of the
    pipeline: latency less stage time of a batch that fills the latency budget ``t_target``
    (the scheduler fills iterations to it; a first token rides the last chunk's batch)."""
    if model.spp == 1:
        return 0.0
    n = largest_chunk(model, BatchPlan((), ()), "_", 0, 1 << 20, t_target) or 1
    plan = BatchPlan((), (ScheduledChunk("_", 0, n, True),))
    return max(model.predict(plan) - model.stage_time(plan), 0.0)


@functools.lru_cache(maxsize=4)
def _esp_costs(model: str, hardware: str, instance_tp: int) -> EspCosts:
    return EspCosts(model, hardware, instance_tp)


def esp_costs(cfg: SimConfig) -> EspCosts:
    return _esp_costs(cfg.model, cfg.hardware, cfg.esp_instance_tp)


def esp_instances(cfg: SimConfig) -> int:
    """LoongServe's elastic instances on the mesh's GPUs."""
    gpus = cfg.tp * cfg.spp * cfg.kvp
    if gpus % cfg.esp_instance_tp:
        raise ValueError(f"{gpus} GPUs do not split into TP-{cfg.esp_instance_tp} instances")
    return gpus // cfg.esp_instance_tp


def build(policy: str, cfg: SimConfig, clock: VirtualClock, max_context: int
          ) -> tuple[SchedulerBase, RuntimePredictor]:
    """A fresh scheduler (with its KV pool) and the time model that executes its plans."""
    entry = registry.policy(policy, "simulator")
    budget = cfg.max_num_batched_tokens if entry.predictor else cfg.sarathi_chunk  # fixed chunks
    limits = registry.Limits(cfg.max_num_seqs, budget, cfg.max_prefill_seqs)

    def pool(kv_tokens: int) -> PageAllocator:
        return PageAllocator(kv_tokens // cfg.page_size + 1, cfg.page_size,
                              prefix_caching=cfg.prefix_caching)

    model = _time_model(cfg.model, cfg.hardware, cfg.tp, cfg.spp, cfg.kvp)
    alloc = pool(cfg.kv_cache_tokens or model.kv_cache_tokens(cfg.memory_fraction))
    if cfg.prefix_caching and cfg.host_tier_tokens:
        alloc.host = HostTier(cfg.host_tier_tokens // cfg.page_size)
    spec = registry.SchedulerSpec(
        policy, limits, where="simulator",
        deadline=DeadlineConfig(t_target=cfg.iteration_budget, space_sharing=False,
                                due_first=cfg.due_first, quick_first=cfg.quick_first))
    sched = registry.build_scheduler(
        spec, alloc, predictor=model, clock=clock,
        prefill_cache=_prefill_cache(cfg, max_context) if entry.predictor else None)
    if alloc.host is not None:
        page_s = cfg.page_size * model.kv_token_bytes() / (cfg.host_gb_per_s * 1e9)
        sched.restore_seconds = lambda pages: pages * page_s
    return sched, model


def saturation(trace: Sequence[TraceRequest], policy: str, cfg: SimConfig = SimConfig()
               ) -> float:
    """The time model's saturation QPS of ``policy`` on ``cfg`` for ``trace``'s lengths
    (``jserve.sim.capacity``)."""
    if policy == "loongserve":
        return saturation_qps(esp_work_s(trace, esp_costs(cfg), esp_instances(cfg)))
    model = _time_model(cfg.model, cfg.hardware, cfg.tp, cfg.spp, cfg.kvp)
    max_context = _max_context(trace)
    if policy == "sarathi":  # fixed chunks, no time budget
        cache = _cached_prefill_cache(cfg.model, cfg.hardware, cfg.tp, cfg.spp, cfg.kvp,
                                      1e9, cfg.sarathi_chunk, max_context)
    else:
        cache = _prefill_cache(cfg, max_context)
    return saturation_qps(mesh_work_s(trace, cache.time, model.stage_time))


def isolated_ttfts(trace: Sequence[TraceRequest], cfg: SimConfig = SimConfig()) -> list[float]:
    """Each request's time to first token alone on ``cfg``'s mesh: its prefill in the
    deadline policies' adaptive chunks plus the pipeline's last pass (the table their slack
    uses). A deadline policy cannot serve a request faster than this."""
    cache = _prefill_cache(cfg, _max_context(trace))
    return [cache.remaining(t.prompt_tokens, 0) for t in trace]


def default_ttft_deadlines(trace: Sequence[TraceRequest], cfg: SimConfig = SimConfig()
                           ) -> list[float]:
    """The TTFT deadline (seconds after arrival) the deadline policies give each request of
    ``trace`` on ``cfg`` by default: max(k x isolated prefill, floor)."""
    k, floor = DeadlineConfig.ttft_k, DeadlineConfig.ttft_floor
    return [t.ttft_deadline_s if t.ttft_deadline_s is not None else max(k * alone, floor)
            for t, alone in zip(trace, isolated_ttfts(trace, cfg))]


def _max_context(trace: Sequence[TraceRequest]) -> int:
    """The longest sequence rounded up, so runs can share a prefill-time cache."""
    longest = max(t.prompt_tokens + t.output_tokens for t in trace)
    return -(-longest // _CONTEXT_STEP) * _CONTEXT_STEP


def run(trace: Sequence[TraceRequest], policy: str, cfg: SimConfig = SimConfig()) -> list[dict]:
    """Simulates ``trace`` under ``policy``; one record per request in arrival order."""
    if policy == "loongserve":
        return simulate_loongserve(trace, esp_costs(cfg), esp_instances(cfg),
                                   memory_fraction=cfg.memory_fraction, horizon_s=cfg.horizon_s)
    return run_with_scheduler(trace, policy, cfg)[0]


def run_with_scheduler(trace: Sequence[TraceRequest], policy: str, cfg: SimConfig = SimConfig()
                       ) -> tuple[list[dict], SchedulerBase]:
    """``run`` (not loongserve), and the scheduler after it (its counters)."""
    clock = VirtualClock()
    sched, predictor = build(policy, cfg, clock, _max_context(trace))
    return simulate(sched, predictor, clock, trace, policy, horizon_s=cfg.horizon_s), sched

"""Building an engine's parts from the model and ``EngineConfig``: checks the config against
the model and the devices, then makes the mesh, the step buckets, the KV pool and its
allocator, the scheduler (with its swap policy), the model runner and the step builder."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jserve import backend as jserve_backend
from jserve.cache.allocator import PageAllocator, held_pages
from jserve.cache.hybrid import local_window
from jserve.cache.pool import (
    allocate_kv_cache,
    kv_bytes_per_page,
    num_pages_for_budget,
    row_major,
)
from jserve.config import ModelConfig
from jserve.engine.batch.buckets import Buckets, ladder_factor
from jserve.engine.batch.builder import BuilderSpec, RequestHooks, StepBuilder
from jserve.engine.batch.burst import DecodeBursts
from jserve.engine.build.kv_groups import KVGroups, kv_groups
from jserve.engine.build.startup import StartupTimes
from jserve.engine.config import EngineConfig, layer_flags
from jserve.engine.device.adapters import build_adapters
from jserve.engine.device.runner import ModelRunner
from jserve.engine.loop.timing import estimated_predictor, host_round_trip_seconds, load_predictor
from jserve.engine.programs.abstract import abstract_kv_cache, params_on_one_device
from jserve.engine.programs.lowering import ProgramModes, pinned_pages
from jserve.engine.programs.step_program import runtime_params
from jserve.engine.requests import prompt_logprobs
from jserve.engine.requests.pooling import Pooler
from jserve.engine.requests.state import plain_sampler_row
from jserve.kernels import ATTENTION_IMPLS, resolve_impl
from jserve.lora.config import pool_size
from jserve.lora.slots import AdapterSlots
from jserve.model.params import Params
from jserve.probe.length_probe import LengthProbe
from jserve.probe.tracker import LengthTracker
from jserve.scheduler import (
    BatchPlan,
    Limits,
    ScheduledChunk,
    SchedulerSpec,
    build_scheduler,
    policy,
)
from jserve.scheduler.base import SchedulerBase
from jserve.scheduler.deadline import DeadlineConfig
from jserve.scheduler.predictor import CorrectedPredictor, RuntimePredictor
from jserve.scheduler.swap import SwapPolicy
from jserve.speculative.draft_model import NewEngine
from jserve.speculative.speculator import Speculator, build_speculator
from sharding import pipeline
from sharding.mesh import MeshConfig, make_mesh
from sharding.specs import allocate_sharded_kv_cache, kv_head_map, kv_heads_per_device

log = logging.getLogger(__name__)


def enable_compilation_cache(path: str | None) -> None:
    """Persistent XLA cache: restarts and repeated test processes skip recompiling. Every
    program is written, however quick its compile (JAX's default skips those under 1 s)
    and however small (-1: no size floor, and JAX does not override it at cache start the
    way it may override 0)."""
    if path is None:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@dataclasses.dataclass
class EngineParts:
    mesh_config: MeshConfig
    multi_process: bool
    max_model_len: int
    buckets: Buckets
    allocator: PageAllocator
    scheduler: SchedulerBase
    runner: ModelRunner
    builder: StepBuilder
    predictor: RuntimePredictor | None      # the deadline policies' step-time model
    length_tracker: LengthTracker | None
    pooler: Pooler | None                   # runner "pooling": each prompt's embedding
    persistent_cache_hits: int | None       # compiled programs found on disk (warm-up on)
    speculator: Speculator                  # speculative decoding (off without a config)
    bursts: DecodeBursts                    # decode bursts (off unless configured)
    adapters: AdapterSlots | None           # LoRA adapters (None: none served)


def check_config(cfg: ModelConfig, config: EngineConfig) -> Geometry:
    """Every refusal that needs no device memory: names, the mesh against the model and the
    processes, the context length."""
    if config.attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, "
                         f"got {config.attention_impl!r}")
    policy(config.scheduler)  # ValueError naming the choices
    geo = engine_geometry(cfg, config)
    if jax.process_count() > 1 and config.lora is not None:  # followers' pools stay empty
        raise ValueError("LoRA adapters are not supported with multi-process serving yet")
    if jax.process_count() > 1 and geo.mesh_config.size != jax.device_count():
        raise ValueError(f"mesh {config.mesh!r}: with {jax.process_count()} processes it "
                         f"must cover all {jax.device_count()} devices")
    return geo


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What the engine derives from its config before allocating (``LLMEngine.__init__``)."""

    mesh_config: MeshConfig
    max_model_len: int
    buckets: Buckets
    pages_per_seq: int       # pages of one sequence in one kvp group's pool at most
    max_useful_pages: int    # every sequence slot at full context (the pool's cap, sink aside)
    # The sliding window a running sequence frees its passed pages by (``kv_window``, with
    # one KV group; jserve.cache.allocator), and the most tokens a step computes for it.
    window: int | None = None
    max_chunk: int = 1


def engine_geometry(cfg: ModelConfig, config: EngineConfig) -> Geometry:
    """The mesh, context length, buckets and pool cap ``LLMEngine`` would use (the buckets
    for the platform programs are built for: ``jserve.backend.current``)."""
    mc = MeshConfig.parse(config.mesh)
    if mc.dp > 1:
        raise ValueError(f"mesh {config.mesh!r}: dp > 1 not supported yet (tensor, "
                         "KV-cache and stream pipeline parallelism, tp/kvp/spp=N, run)")
    mc.validate(cfg)
    if mc.spp > 1:
        pipeline.validate(cfg, mc.spp)
    max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 8192)
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    budget = min(config.max_num_batched_tokens, max_model_len)
    buckets = Buckets.for_limits(
        max_num_seqs=config.max_num_seqs, token_budget=budget,
        max_prefill_seqs=config.max_prefill_seqs, max_model_len=max_model_len,
        page_size=config.page_size, kvp=mc.kvp,
        draft_tokens=(config.speculative_config.num_speculative_tokens
                      if config.speculative_config else 0),
        factor=ladder_factor(jserve_backend.current()))
    window = cfg.kv_window if mc.kvp == 1 else None
    max_chunk = max(budget, config.burst_steps())  # a step's tokens: a chunk, or a burst's
    pages_per_seq = (held_pages(max_model_len, config.page_size, window, max_chunk)
                     if mc.kvp == 1 else buckets.pages_per_group)
    return Geometry(mc, max_model_len, buckets, pages_per_seq,
                    config.max_num_seqs * pages_per_seq, window, max_chunk)


def length_tracker(cfg: ModelConfig, config: EngineConfig) -> LengthTracker | None:
    """The probe's tracker when a probe or a capture layer is set (sprpt needs a probe)."""
    probe = LengthProbe.load(config.length_probe) if config.length_probe else None
    if probe is not None:
        if probe.input_dim != cfg.hidden_size:
            raise ValueError(f"length probe reads {probe.input_dim}-wide embeddings; the "
                             f"model's hidden size is {cfg.hidden_size}")
        if config.probe_layer is not None and config.probe_layer != probe.layer:
            raise ValueError(f"probe_layer {config.probe_layer} differs from the probe's "
                             f"layer {probe.layer}")
    elif policy(config.scheduler).length_probe:
        raise ValueError("scheduler 'sprpt' needs a length probe (length_probe=path)")
    layer = probe.layer if probe is not None else config.probe_layer
    if layer is None:
        return None
    if layer >= cfg.num_hidden_layers:
        raise ValueError(f"probe layer {layer} is past the model's {cfg.num_hidden_layers} "
                         "layers")
    return LengthTracker(probe, layer)


def _pooler(cfg: ModelConfig, config: EngineConfig, geo: Geometry) -> Pooler | None:
    """The embeddings' reader of the captured final norm (runner "pooling"), on one device;
    a base-model checkpoint (no LM head) only there."""
    if config.runner != "pooling":
        if cfg.base_model or cfg.num_labels:
            kind = "a sequence classifier" if cfg.num_labels else "a base model"
            raise ValueError(f"this checkpoint is {kind} ({cfg.architecture} without its LM "
                             f"head, as embedding and cross-encoder models are saved): "
                             f"serve it with runner='pooling' (--runner pooling)")
        return None
    if geo.mesh_config.size > 1 or jax.process_count() > 1:
        raise ValueError("runner='pooling' runs on one device for now, not on a mesh "
                         f"({config.mesh!r})")
    return Pooler(config.pooler_config, cfg.num_hidden_layers)


def _prefix_caching(config: EngineConfig, tracker: LengthTracker | None,
                    pooler: Pooler | None) -> bool:
    """Prefix caching as configured, but off where every prompt token must go through the
    model: a length probe, mean pooling."""
    on = config.enable_prefix_caching and tracker is None and not (
        pooler is not None and pooler.spec.mode == "mean")
    if config.enable_prefix_caching and not on:
        log.info("prefix caching is off: not supported with a length probe or mean pooling "
                 "(every prompt token must go through the model)")
    return on


def _num_kv_pages(cfg: ModelConfig, config: EngineConfig, geo: Geometry) -> int:
    """One kvp group's pool per device, sized by the heads a device stores under tp and the
    layers of its pipeline stage; a sequence keeps at most ``pages_per_group`` pages in one
    group, and the groups' pools sit side by side in the cache's page dimension (global id
    = group * pool + local id; jserve.cache.allocator)."""
    mc = geo.mesh_config
    return config.num_kv_pages or num_pages_for_budget(
        cfg, config.page_size, kv_cache_bytes=config.kv_cache_bytes,
        memory_fraction=config.memory_fraction, max_useful_pages=geo.max_useful_pages,
        kv_heads=kv_heads_per_device(cfg, mc.tp), num_layers=cfg.num_hidden_layers // mc.spp,
        kv_cache_dtype=config.kv_cache_dtype)


def _swap_policy(cfg: ModelConfig, config: EngineConfig, mesh_config: MeshConfig,
                 predictor: RuntimePredictor | None, groups: KVGroups | None = None
                 ) -> SwapPolicy | None:
    """Swapping moves pages through the host memory of one process and not under a
    pipeline, nor with two KV layer groups (``preemption="auto"`` then recomputes);
    elsewhere, and with ``preemption="recompute"``, victims recompute."""
    if (config.preemption == "recompute" or jax.process_count() > 1 or mesh_config.spp > 1
            or groups is not None):
        return None
    cost = predictor or estimated_predictor(cfg)
    return SwapPolicy(
        config.preemption, capacity_bytes=config.swap_space_bytes,
        # A swapped page is a global page: every stored KV head (copies under tp included).
        page_bytes=kv_bytes_per_page(cfg, config.page_size,
                                     len(kv_head_map(cfg, mesh_config.tp)),
                                     kv_cache_dtype=config.kv_cache_dtype),
        round_trip_seconds=host_round_trip_seconds,
        recompute_seconds=lambda tokens: cost.predict(BatchPlan((), (ScheduledChunk(
            "", 0, tokens, False),))))


def host_tier_on(config: EngineConfig, mesh_config: MeshConfig) -> bool:
    """Whether the prefix cache's host tier may run (``host_pages.build_host_tier`` has the
    rest of the rule): its copies are the swap programs', compiled at start with the steps."""
    return config.kv_offload_bytes > 0 and mesh_config.spp == 1 and jax.process_count() == 1


def _scheduler(config: EngineConfig, allocator: PageAllocator, budget: int,
               context: int, predictor: RuntimePredictor | None,
               tracker: LengthTracker | None) -> SchedulerBase:
    probe = tracker.probe if tracker else None
    spec = SchedulerSpec(
        config.scheduler, Limits(config.max_num_seqs, budget, config.max_prefill_seqs),
        deadline=DeadlineConfig(t_target=config.iteration_budget, ttft_k=config.ttft_slo_factor,
                                ttft_floor=config.ttft_slo_floor,
                                space_sharing=config.space_sharing,
                                prefill_share=config.prefill_share,
                                full_chunk_alone=config.full_chunk_alone),
        sprpt_c=config.sprpt_c, fallback_remaining=probe.prior_mean if probe else None,
        max_context=context)
    return build_scheduler(spec, allocator, predictor=predictor)


def build_engine_parts(cfg: ModelConfig, params: Params, config: EngineConfig,
                       times: StartupTimes | None = None,
                       new_engine: NewEngine | None = None) -> EngineParts:
    """``new_engine``: makes the engine a draft model proposes from (speculative decoding)."""
    times = times if times is not None else StartupTimes()
    geo = check_config(cfg, config)
    mesh_config, buckets, context = geo.mesh_config, geo.buckets, geo.max_model_len
    budget = min(config.max_num_batched_tokens, context)
    groups = kv_groups(cfg, config, mesh_size=mesh_config.size, max_model_len=context,
                       layer_mode=config.layer_mode(cfg.num_hidden_layers, mesh_config.spp,
                                                    windowed=local_window(cfg) is not None),
                       max_chunk=geo.max_chunk)
    num_pages = groups.global_pages if groups else _num_kv_pages(cfg, config, geo)
    predictor = (load_predictor(cfg, config)
                 if policy(config.scheduler).predictor else None)
    if predictor is not None and config.predictor_correction:
        predictor = CorrectedPredictor(predictor)
    tracker = length_tracker(cfg, config)
    pooler = _pooler(cfg, config, geo)
    capture = tracker or pooler  # what the step captures its hidden states for
    prefix_caching = _prefix_caching(config, tracker, pooler)
    allocator = groups.allocator(config.page_size, prefix_caching, geo.max_chunk) if groups \
        else PageAllocator(num_pages, config.page_size, groups=mesh_config.kvp,
                           pages_per_group=buckets.pages_per_group,
                           prefix_caching=prefix_caching, window=geo.window,
                           max_chunk=geo.max_chunk)
    scheduler = _scheduler(config, allocator, budget, context, predictor, tracker)
    scheduler.swap_policy = _swap_policy(cfg, config, mesh_config, predictor, groups)
    # Padding a step up to a compiled shape needs one process (followers run the leader's
    # shapes) and no pipeline (a tick's shape covers its slots' own).
    defer = (config.warmup in ("core", "background") and mesh_config.spp == 1
             and jax.process_count() == 1)
    burst_ok = bursts_allowed(config, mesh_config, capture)
    plan = RunnerPlan(geo, num_pages, capture, defer, groups and groups.local_pages,
                      config.burst_steps() if burst_ok else 1,
                      scheduler.swap_policy is not None or host_tier_on(config, mesh_config))
    runner, hits = _runner(cfg, params, config, plan, times)
    if pooler is not None and cfg.num_labels:  # a classifier's head, read on the host
        pooler.head = np.asarray(runner.params["score"], np.float32)
    programs = runner.programs
    times.deferred = len(programs.deferred_shapes()) + (programs.samplers_missing() if defer
                                                        else 0)
    if defer:  # counted first: the background thread starts on the sampler at once
        programs.defer(compile_rest=config.warmup == "background")
    speculator = build_speculator(config, cfg, context, scheduler, new_engine)
    scheduler.adapters = adapters = build_adapters(cfg, config.lora, runner)
    bursts = DecodeBursts(config.burst_steps(), burst_ok, scheduler, runner, buckets, context)
    return EngineParts(
        mesh_config, jax.process_count() > 1, context, buckets, allocator, scheduler,
        runner, _builder(config, plan, runner, cfg.vocab_size, adapters),
        predictor, tracker, pooler, hits, speculator, bursts, adapters)


@dataclasses.dataclass(frozen=True)
class RunnerPlan:
    """What the factory decided the runner and the step builder are built for, beside the
    model, its weights and the config."""

    geo: Geometry
    num_pages: int
    capture: LengthTracker | Pooler | None  # what the step captures hidden states for
    # Steps of shapes not compiled yet run padded up to a compiled one while theirs compiles
    # in the background (so warm-up compiles only the core shapes).
    defer: bool
    local_pages: int | None  # two KV layer groups: the windowed layers' pool (``KVGroups``)
    burst_steps: int         # the decode bursts' steps (1: none)
    swaps: bool              # the swap programs compile with the steps (``StepPrograms.swaps``)


def _builder(config: EngineConfig, plan: RunnerPlan, runner: ModelRunner, vocab_size: int,
             adapters: AdapterSlots | None) -> StepBuilder:
    """The step builder over the runner's programs."""
    programs = runner.programs
    spec = BuilderSpec(config.page_size, runner.state_sink, pool_pages=plan.num_pages,
                       vocab_size=vocab_size, hybrid=plan.local_pages is not None,
                       whole_chain_decodes=programs.lowering.modes.whole_chain_decodes)
    hooks = RequestHooks(plain_row=plain_sampler_row, prompt_logprobs=prompt_logprobs.wanted,
                         lora_slot=adapters and (lambda r: adapters.slot(r.adapter)))
    return StepBuilder(plan.geo.buckets, spec, hooks,
                       ready=programs.ready_shape if plan.defer else None,
                       # spp > 1: a tick packs its slots itself
                       layout=programs.lowering.layout if plan.geo.mesh_config.spp == 1
                       else None)


def whole_chain_decodes(backend: str) -> bool:
    """Whether the all-decode steps (with bursts) sample with the whole chain, so that
    requests with filters, penalties or a bias burst too: on a GPU or TPU, where the host's
    per-step work is what bursts save and the programs compile in parallel on many cores;
    not on a CPU, where the chain was half of each step program's compile on 2 cores and
    bursts buy little (docs/startup.md, "Decode bursts in the step program")."""
    return backend in ("gpu", "tpu")


def describe_run(times: StartupTimes, cfg: ModelConfig, config: EngineConfig,
                 mesh_config: MeshConfig, layer_mode: str) -> None:
    """What the start-up line says runs: backend, the engine's devices (count and kind),
    the attention kernel ``attention_impl`` resolves to, the layer mode and the dtype."""
    device = jax.devices()[0]
    times.backend = jax.default_backend()
    times.devices = f"{mesh_config.size} x {device.device_kind}"
    times.attention = resolve_impl(config.attention_impl)
    times.layer_mode, times.dtype = layer_mode, cfg.dtype


def _warm(runner: ModelRunner, times: StartupTimes, plan: RunnerPlan) -> int:
    """``runner``'s warm-up (``StepPrograms.warmup``) timed into ``times``; returns the
    persistent-cache hits."""
    t0 = time.perf_counter()
    programs = runner.programs
    programs.swaps = plan.swaps
    programs.warmup(core=plan.defer)
    times.programs += time.perf_counter() - t0
    times.cached = programs.cache_events["cache_hits"]
    times.compiled = programs.compiled_up_front - times.cached
    times.compile_seconds = sum(programs.compile_times.values())
    times.threads = programs.threads
    return times.cached


def runner_options(config: EngineConfig, buckets: Buckets, mesh: jax.sharding.Mesh | None,
                   layer_mode: str, tracker: LengthTracker | Pooler | None,
                   burst_steps: int) -> dict:
    """``ModelRunner``'s arguments beside the model, params and pages: the same for the
    engine's runner and for one compiled for a target (``jserve.targets.programs``)."""
    modes = ProgramModes(capture_layer=tracker.layer if tracker else None,
                         **layer_flags(layer_mode), burst_steps=burst_steps,
                         whole_chain_decodes=whole_chain_decodes(jserve_backend.current()))
    return dict(buckets=buckets, max_num_seqs=config.max_num_seqs,
                attention_impl=config.attention_impl, mesh=mesh, modes=modes)


def bursts_allowed(config: EngineConfig, mesh_config: MeshConfig,
                   tracker: LengthTracker | Pooler | None) -> bool:
    """Bursts need one device and process, no KV-cache parallelism, no captured state (a
    length probe's, embeddings') and no speculative decoding (untested together)."""
    return (mesh_config.spp == 1 and mesh_config.kvp == 1 and jax.process_count() == 1
            and tracker is None and config.speculative_config is None)


def _allocate_kv(cfg: ModelConfig, config: EngineConfig, mesh, num_pages: int,
                 local_pages: int | None, tracker: LengthTracker | Pooler | None):
    """The zeroed pool: on one device, split on ``mesh``, or made in the steps' pinned
    layout (``lowering.pinned_pages``)."""
    spp = mesh.shape["spp"] if mesh is not None else 1
    if pinned_pages(config.attention_impl, spp, tracker.layer if tracker else None):
        return row_major(abstract_kv_cache(cfg, num_pages, config.page_size, mesh,
                                           kv_cache_dtype=config.kv_cache_dtype,
                                           local_pages=local_pages), zeros=True)
    if mesh is None:
        return allocate_kv_cache(cfg, num_pages, config.page_size, config.kv_cache_dtype,
                                 local_pages)
    return allocate_sharded_kv_cache(cfg, mesh.shape["kvp"] * num_pages, config.page_size,
                                     mesh, config.kv_cache_dtype)


def _runner(cfg: ModelConfig, params: Params, config: EngineConfig, plan: RunnerPlan,
            times: StartupTimes) -> tuple[ModelRunner, int | None]:
    """The runner, its programs warmed up (``config.warmup``), and how many came from the
    persistent cache (None: no warm-up). On one device the weights and KV pages load in a
    thread while the programs compile against their specs; on a mesh they load first."""
    mesh_config, num_pages, local_pages = plan.geo.mesh_config, plan.num_pages, plan.local_pages
    mesh = make_mesh(mesh_config) if mesh_config.size > 1 else None
    placed = hasattr(params, "place")  # a lazy checkpoint streams onto the mesh
    layer_mode = config.layer_mode(cfg.num_hidden_layers, mesh_config.spp,
                                   windowed=local_window(cfg) is not None)
    describe_run(times, cfg, config, mesh_config, layer_mode)
    unroll = layer_mode == "unrolled"  # per-layer arrays; "sliced" keeps them stacked
    warm = config.warmup != "none"

    def load_weights() -> Params:
        t0 = time.perf_counter()
        p = params.place(cfg, mesh) if placed else params
        p = jax.block_until_ready(runtime_params(cfg, p, mesh, placed=placed, unroll=unroll,
                                                 lora=pool_size(config.lora)))
        times.weights = time.perf_counter() - t0
        return p

    def allocate_kv():
        t0 = time.perf_counter()
        kv = jax.block_until_ready(_allocate_kv(cfg, config, mesh, num_pages, local_pages,
                                                plan.capture))
        times.kv = time.perf_counter() - t0
        return kv

    def warmup(runner: ModelRunner) -> int | None:
        return _warm(runner, times, plan) if warm else None

    make = functools.partial(ModelRunner, **runner_options(config, plan.geo.buckets, mesh,
                                                           layer_mode, plan.capture,
                                                           plan.burst_steps))
    if mesh is not None or not warm:
        runner = make(cfg, load_weights(), allocate_kv(), params_placed=True)
        return runner, warmup(runner)
    times.overlapped = True
    with ThreadPoolExecutor(1, thread_name_prefix="jserve-load") as loader:
        loaded = loader.submit(lambda: (load_weights(), allocate_kv()))
        runner = make(cfg, params_on_one_device(cfg, unroll, lora=pool_size(config.lora)),
                      abstract_kv_cache(
            cfg, num_pages, config.page_size, None, kv_cache_dtype=config.kv_cache_dtype,
            local_pages=local_pages),
            abstract=True)
        hits = warmup(runner)
        weights, kv = loaded.result()
    if not runner.attach(weights, kv):
        hits = warmup(runner)
    return runner, hits

"""Engine settings (frozen; built from ``LLM(...)`` keywords or CLI flags). The model's
architecture is ``jserve.config.ModelConfig``; this module is the serving side's."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jserve.config import KV_CACHE_DTYPES
from jserve.lora.config import LoRAConfig
from jserve.pooling import PoolingSpec
from jserve.speculative.config import SpeculativeConfig
from sharding.mesh import MeshConfig

WARMUP_MODES = ("core", "background", "all", "none")
RUNNERS = ("generate", "pooling")
LAYER_LOOPS = ("auto", "loop", "unrolled", "sliced", "indexed", "sliced-indexed")
# Decode burst steps of ``decode_burst="auto"`` (``burst_steps``): a request arriving during
# a burst waits at most 3 steps for it.
AUTO_BURST_STEPS = 4


def default_compilation_cache_dir() -> str:
    return os.environ.get("JSERVE_COMPILATION_CACHE",
                          str(Path.home() / ".cache" / "jserve" / "xla"))


def layer_flags(mode: str) -> dict:
    """``ProgramModes``' layer fields for a ``layer_mode``: stacked weights unrolled over
    static slices (``slice_layers``), or read in place (``in_place_layers``: True, or
    "decode" for the decode-only steps alone)."""
    return dict(slice_layers=mode in ("sliced", "sliced-indexed"),
                in_place_layers={"indexed": True, "sliced-indexed": "decode"}.get(mode, False))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 32             # running sequences (decode rows) at most
    max_num_batched_tokens: int = 256  # token budget per iteration (the chunk size limit)
    max_prefill_seqs: int = 4          # prefill chunks per iteration at most
    max_model_len: int | None = None   # default: min(model's max positions, 8192)
    page_size: int = 16
    # Explicit KV budget; else memory_fraction of free device memory (on CPU of the host's
    # total RAM, at most 4 GiB: jserve.cache.pool.cpu_kv_budget, the same every start).
    kv_cache_bytes: int | None = None
    # Exact KV pool size in pages per device (one kvp group's pool; the reserved sink page
    # included), like vLLM's num_gpu_blocks_override; excludes kv_cache_bytes.
    num_kv_pages: int | None = None
    # A model with windowed and full-attention layers (Gemma 3) keeps two pools
    # (jserve.cache.hybrid): num_kv_pages sizes the full-attention layers' and this the
    # windowed layers' (sink included; None: num_kv_pages scaled as jserve.engine.build.kv_groups).
    num_local_kv_pages: int | None = None
    memory_fraction: float = 0.5
    # How KV pages are stored (jserve.kernels.kv_quant): auto (the model's dtype) | int8 (per
    # token and KV head scales) | fp8_e4m3 | fp8_e5m2 (one fixed scale). The budget above
    # counts pages at their stored size, so int8/fp8 hold about 2x the tokens of bf16.
    kv_cache_dtype: str = "auto"
    # auto | reference | pallas_gpu | pallas_tpu | cpu (jserve.kernels): auto is the backend's
    # kernel where it has run on the hardware: the Pallas GPU kernel (checked on an H100,
    # docs/device.md), the native decode kernel on CPU (where it builds), the XLA reference
    # on TPU until pallas_tpu has run on a TPU. A Pallas flavour on CPU runs interpreted.
    attention_impl: str = "auto"
    # jserve.scheduler.ENGINE_POLICIES: fcfs | sarathi | edf | lrs | lars | sprpt
    scheduler: str = "sarathi"
    # Output-length probe (TRAIL, jserve.probe): a probe .npz turns on capturing its layer's
    # hidden state and per-request remaining-length predictions; probe_layer alone captures
    # that layer without predicting (recording training data). sprpt needs a probe and
    # preempts a request only while generated <= sprpt_c x its first prediction.
    length_probe: str | None = None
    probe_layer: int | None = None
    sprpt_c: float = 0.8
    # Deadline-aware policies: the time budget of one iteration (seconds; the paper's TPOT
    # SLO, t_target; ``tpot_slo`` before, which names a request's own SLO: an ``LLM`` keyword
    # and the --tpot-slo flag still take the old name, deprecated); a request's TTFT
    # deadline defaults to max(ttft_slo_factor x its isolated prefill time, ttft_slo_floor).
    iteration_budget: float = 0.05
    ttft_slo_factor: float = 1.5
    ttft_slo_floor: float = 0.5
    space_sharing: bool = True
    # The progress rule: a request's own tpot_slo shortens iterations only down to their
    # decodes' time plus this share of iteration_budget (jserve.scheduler.deadline).
    prefill_share: float = 0.75
    # A deadline policy's prefill alone in an iteration (no decode, no other prefill) runs
    # a whole max_num_batched_tokens chunk, not one cut to iteration_budget
    # (jserve.scheduler.deadline.DeadlineConfig.full_chunk_alone).
    full_chunk_alone: bool = True
    predictor_path: str | None = None  # default: the one `jserve profile` saved for this model
    # Scale the predictor online by measured / predicted step time (one device), so a
    # profile from a quieter machine or the fallback estimate still packs to the budget.
    predictor_correction: bool = True
    # Preemption under KV pressure: "auto" swaps a victim's KV to host memory when the copy
    # is predicted cheaper than recomputing it, within swap_space_bytes of host memory.
    preemption: str = "auto"           # auto | swap | recompute
    swap_space_bytes: int = 4 << 30
    # Automatic prefix caching (docs/prefix_cache.md): full KV pages are shared between
    # requests with the same leading tokens. Off under spp, for requests with penalties and
    # with a length probe (they need every prompt token to go through the model).
    enable_prefix_caching: bool = True
    # The prefix cache's host tier (docs/prefix_cache.md): cached pages the device evicts are
    # copied to a host pool of this many bytes (least recently used out first) and come
    # back by copy, not by recompute. 0: off (the default: host RAM is the serving host's
    # to give, shared with other processes and on CPU the device pool's own memory).
    kv_offload_bytes: int = 0
    # Decoder layers as one loop over stacked weights ("loop": compile time independent of
    # depth), unrolled over per-layer weight arrays ("unrolled": XLA:CPU does not copy each
    # layer's weights every step, ~2x faster decode at small batches, compile time grows
    # with depth), or unrolled in the program over static slices of the stacked weights
    # ("sliced", spp == 1 only: XLA:GPU neither copies the weights, as it does for the
    # loop's dynamic slices, nor pays per-argument dispatch for hundreds of arrays;
    # docs/device.md). "indexed": the loop over stacked weights, each matmul reading its
    # layer's tiles in place with a Pallas kernel (jserve.kernels.layer_matmul: compile time
    # of the loop and no weight copy; any spp; interpreted, so slow, on CPU).
    # "sliced-indexed" (spp == 1): the decode-only steps indexed (their burst loop would
    # copy sliced layers: 1.41 GB a step at 1B on an H100, ``jserve compile``), the steps
    # with prefill tokens sliced (XLA's GEMMs for the large matmuls).
    # "auto": sliced-indexed on GPU without spp (sliced for a model whose KV layer groups
    # need every step's layers unrolled); unrolled on CPU at any depth (the loop's copies
    # made a 12-layer decode step 1.7x slower, more than deeper unrolled programs cost to
    # compile once: docs/startup.md); else unrolled up to 8 layers per pipeline stage (the
    # whole model without spp), else indexed on GPU and TPU. (docs/device.md, "Compiled
    # for".)
    layer_loop: str = "auto"
    seed: int = 0                      # draws seeds for requests that give none
    # "tp=2,kvp=2,spp=2" (sharding.MeshConfig: dp, spp, kvp, ep, tp); dp is not supported yet.
    mesh: str = "tp=1"
    # Which step programs compile before the engine is ready (docs/startup.md): "all" (the
    # whole fixed set: every bucket shape's step, the samplers, decode bursts and swap
    # programs when on, compiled on a thread pool with the persistent cache, so nothing
    # compiles while serving; True), "core" (the largest step, which covers every other
    # padded, and the one-row decode; any other shape compiles in a background thread the
    # first time a step needs it and runs padded up to a compiled shape until then),
    # "background" (core, then every other shape in the background right away) or "none"
    # (each shape compiles on first use, and its step waits; False).
    # With spp > 1 or several processes, "core" and "background" mean "all".
    warmup: str = "all"
    # Plan and build step N+1 on the host while step N runs on the device; sampled tokens
    # stay there and feed the next step, the host reads them one step later. False: every
    # step waits for its tokens (debugging, exact step timing).
    async_scheduling: bool = True
    # Decode bursts (jserve.engine.batch.burst): when nothing waits and every running request may
    # take this many tokens with no host decision between them, they run as that many decode
    # steps in one executable call, so the host's per-step work is paid once a burst. A
    # request arriving meanwhile waits for the burst to end. 1: off. "auto":
    # AUTO_BURST_STEPS (``burst_steps``).
    decode_burst: int | str = "auto"
    compilation_cache_dir: str | None = dataclasses.field(
        default_factory=default_compilation_cache_dir)
    # Speculative decoding (docs/speculative.md): vLLM's dict, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1} or
    # {"method": "draft_model", "model": "<path or name>", "num_speculative_tokens": 4}
    # (or its JSON text); parsed into a SpeculativeConfig. None: off.
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --runner: "generate", or "pooling" (embeddings, jserve.engine.requests.pooling: every
    # request is one prompt's pooled vector, nothing generated). pooler_config (a
    # PoolingSpec or its dict; vLLM's --pooler-config): how; None: the checkpoint's
    # (``LLM`` reads it from its sentence-transformers files), else the default.
    runner: str = "generate"
    pooler_config: PoolingSpec | None = None
    # LoRA adapters (vLLM's --enable-lora and its flags; docs/lora.md): the device slot
    # pool, its rank and the adapters known at start. None: no adapters.
    lora: LoRAConfig | None = None

    def burst_steps(self) -> int:
        """The most steps of a decode burst (``decode_burst``; 1: none), before what the mesh
        and the engine's other options allow (``factory``: one device and process, no
        KV-cache or pipeline parallelism, no length probe or speculative decoding) and what
        each request allows (``burst.may_burst``). "auto": ``AUTO_BURST_STEPS`` on every
        backend: a burst is a runtime count in each all-decode shape's step program
        (``step_program._step``), so it adds no program to compile, and the host's per-step
        work is paid once a burst (docs/startup.md, "Decode bursts in the step program")."""
        return AUTO_BURST_STEPS if self.decode_burst == "auto" else int(self.decode_burst)

    def layer_mode(self, num_layers: int, spp: int, backend: str | None = None,
                   windowed: bool = False) -> str:
        """What ``layer_loop`` means for this depth, pipeline and backend (default: the one
        programs are built for): "loop", "unrolled", "sliced", "indexed" or
        "sliced-indexed"; ``windowed``: the model has sliding-window layers beside full ones
        (its KV layer groups need sliced or unrolled layers in every step)."""
        if self.layer_loop in ("sliced", "sliced-indexed") and spp > 1:
            raise ValueError(f"layer_loop {self.layer_loop!r} needs spp == 1 (a pipeline "
                             "stage loops over its own layers)")
        if self.layer_loop != "auto":
            return self.layer_loop
        if backend is None:
            from jserve import backend as jserve_backend  # JAX only when asked
            backend = jserve_backend.current()
        if spp == 1 and backend == "gpu":
            return "sliced" if windowed else "sliced-indexed"
        # XLA:CPU copies each layer's matrices out of the loop's stack every step, and its
        # indexed kernel is interpreted; XLA:GPU copies too, libtpu at batch 32 (docs/device.md,
        # "Compiled for"): the indexed loop reads them in place
        if backend == "cpu" or num_layers // spp <= 8:
            return "unrolled"
        return "indexed"

    def _check_runner(self) -> None:
        """``runner`` and ``pooler_config`` (made a ``PoolingSpec``), and what pooling
        cannot go with."""
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.runner == "pooling":
            object.__setattr__(self, "pooler_config",
                               PoolingSpec.of(self.pooler_config or PoolingSpec()))
            for name, why in (("length_probe", self.length_probe or self.probe_layer),
                              ("speculative_config", self.speculative_config)):
                if why is not None:
                    raise ValueError(f"{name} is not supported with runner='pooling' "
                                     f"(nothing is generated)")
        elif self.pooler_config is not None:
            raise ValueError("pooler_config needs runner='pooling'")

    def _check_lora(self, mesh: MeshConfig) -> None:
        """What LoRA adapters cannot go with yet."""
        if self.lora is None:
            return
        if not isinstance(self.lora, LoRAConfig):
            raise ValueError(f"lora must be a LoRAConfig, got {type(self.lora).__name__}")
        for name, on in (("runner='pooling'", self.runner == "pooling"),
                         ("a stream pipeline (spp > 1)", mesh.spp > 1),
                         ("speculative_config", self.speculative_config is not None)):
            if on:
                raise ValueError(f"LoRA adapters are not supported with {name} yet")

    def __post_init__(self) -> None:
        if isinstance(self.warmup, bool):
            object.__setattr__(self, "warmup", "all" if self.warmup else "none")
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES} (or a bool), "
                             f"got {self.warmup!r}")
        if self.decode_burst != "auto" and (isinstance(self.decode_burst, str)
                                            or self.decode_burst < 1):
            raise ValueError(f"decode_burst must be 'auto' or >= 1, got {self.decode_burst!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, "
                             f"got {self.layer_loop!r}")
        if self.preemption not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption must be 'auto', 'swap' or 'recompute', "
                             f"got {self.preemption!r}")
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        for name in ("iteration_budget", "ttft_slo_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.prefill_share <= 1.0:
            raise ValueError(f"prefill_share must be in [0, 1], got {self.prefill_share}")
        if self.ttft_slo_floor < 0:
            raise ValueError(f"ttft_slo_floor must be >= 0, got {self.ttft_slo_floor}")
        mesh = MeshConfig.parse(self.mesh)
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is not None and mesh.spp > 1:
            raise ValueError("speculative_config is not supported with a stream pipeline "
                             "(spp > 1): a speculating plan is read back before the next")
        if spec is not None and (self.length_probe or self.probe_layer is not None):
            raise ValueError("speculative_config is not supported with a length probe")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.num_kv_pages is not None:
            if self.num_kv_pages < 2:
                raise ValueError(f"num_kv_pages must be >= 2 (one is reserved), "
                                 f"got {self.num_kv_pages}")
            if self.kv_cache_bytes is not None:
                raise ValueError("give kv_cache_bytes or num_kv_pages, not both")
        if not self.sprpt_c >= 0:
            raise ValueError(f"sprpt_c must be >= 0, got {self.sprpt_c}")
        if self.probe_layer is not None and self.probe_layer < 0:
            raise ValueError(f"probe_layer must be >= 0, got {self.probe_layer}")
        self._check_runner()
        self._check_lora(mesh)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

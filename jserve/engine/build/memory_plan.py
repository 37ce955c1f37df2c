"""A memory plan before anything is allocated (``jserve plan``).

``plan(cfg, engine_config, device_memory_bytes)`` builds the engine's mesh and buckets,
describes the runtime params and the KV pages as ``jax.ShapeDtypeStruct``s placed on the
mesh (no weights read, nothing allocated), and lowers and compiles the largest bucket's step
and the sampler through ``ModelRunner(abstract=True)``, the same lowering the engine runs.
From the shardings it counts each device's weight bytes, from ``memory_analysis()`` the
compiled step's temporary memory, and from what is left the KV pages, the tokens they
cache, and whether the configuration fits at all.

The KV budget of a device with ``device_memory_bytes`` is
``device_memory x memory_fraction - weights - penalty state - activation memory``
(activation memory: the larger of the step's and the sampler's temporary buffers), capped,
as in the engine, at every sequence slot at full context; an explicit ``kv_cache_bytes`` or
``num_kv_pages`` in the engine config replaces it. (The engine itself sizes the pool as
``memory_fraction`` of the memory still free once the weights are on the device and
reserves nothing for activations, so the two agree exactly when the budget is explicit.)

A sliding-window model (every layer windowed, one KV group) frees the pages a request's
window has passed while it runs, so a request of any length holds at most
``jserve.cache.allocator.held_pages`` (about one window plus one chunk): the pool's cap, the
"requests at once" figure (``requests_at_once``) and the fit check count that.

``describe_engine(engine)`` gives the same numbers for a running ``LLMEngine``, one log line.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Sequence

import jax
import numpy as np

from jserve.cache.allocator import PageAllocator, held_pages
from jserve.cache.hybrid import local_window
from jserve.cache.pool import available_device_bytes, kv_bytes_per_page
from jserve.config import ModelConfig
from jserve.engine.batch.arrays import state_spec
from jserve.engine.build.factory import Geometry, engine_geometry
from jserve.engine.build.kv_groups import group_window, layer_counts, pool_sizes
from jserve.engine.config import EngineConfig, layer_flags
from jserve.engine.device.runner import ModelRunner
from jserve.engine.programs.abstract import abstract_kv_cache, abstract_params
from jserve.engine.programs.lowering import ProgramModes
from jserve.lora.config import pool_size
from jserve.model.params import active_params, num_params
from sharding.mesh import MeshConfig, make_mesh
from sharding.specs import kv_heads_per_device

GB = 10 ** 9
_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}


def parse_bytes(text: str | int) -> int:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"1.5T"``, ``"123456"`` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: expected e.g. 80GB, 80GiB or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _gb(n: int | float) -> str:
    """Bytes in GB (10^9), or MB / kB when smaller."""
    for unit, scale in (("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10 ** 9 else f"{n / 1e6:.2f} M"


def per_device_bytes(tree) -> int:
    """Bytes of the largest shard any one device holds, summed over ``tree``'s leaves (arrays
    or ``ShapeDtypeStruct``s with a sharding; even splits, so every device holds as much)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def _split_bytes(tree) -> tuple[int, int]:
    """(bytes per device of the leaves split on the mesh's tp axis (what more tp divides),
    of the rest)."""
    split = rest = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        n = math.prod(shard) * np.dtype(leaf.dtype).itemsize
        spec = tuple(getattr(leaf.sharding, "spec", None) or ())
        if "tp" in spec or any(isinstance(e, tuple) and "tp" in e for e in spec):
            split += n
        else:
            rest += n
    return split, rest


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """One executable's ``memory_analysis()`` (per device under SPMD)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int

    @property
    def needed_bytes(self) -> int:
        """Device memory the executable needs: arguments, temporaries and the outputs not
        aliased to an argument."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> "CompiledMemory | None":
        m = compiled.memory_analysis()
        if m is None:  # a backend without the analysis
            return None
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                   int(m.alias_size_in_bytes), int(m.temp_size_in_bytes),
                   int(m.generated_code_size_in_bytes))


@dataclasses.dataclass(frozen=True)
class StorageChoice:
    """One weight quantization x KV cache dtype under the plan's budget (per device)."""

    quantization: str
    kv_cache_dtype: str
    weight_bytes: int
    kv_bytes_per_token: int      # one token's K and V over the device's heads and layers
    num_kv_pages: int            # what the budget holds (the engine caps its pool lower)
    max_cached_tokens: int


@dataclasses.dataclass
class MemoryPlan:
    """Per-device memory of an engine configuration (every byte count is per device)."""

    model: str
    mesh: str
    num_devices: int
    platform: str
    dtype: str
    num_params: int
    active_params: int           # what one token reads (MoE: its k experts; else all)
    weight_bytes: int            # per device, from the shardings
    split_weight_bytes: int      # of which split on tp (more tp divides it further)
    kv_bytes_per_page: int       # one page on one device (its KV heads and layers)
    num_kv_pages: int            # per device (one kvp group's pool; the sink page included)
    kvp: int
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_useful_pages: int        # the pool's cap: every sequence slot at full context
    pages_per_group: int | None  # with kvp > 1: a sequence's pages in one group at most
    state_bytes: int             # the penalty state (replicated)
    step_shape: tuple[int, int] | None   # the compiled bucket: (decode rows, prefill tokens)
    step: CompiledMemory | None
    sampler: CompiledMemory | None
    device_memory_bytes: int | None
    memory_fraction: float
    kv_budget_source: str        # "device memory" | "kv_cache_bytes" | "num_kv_pages" | "engine"
    compile_seconds: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)
    suggested_tp: int | None = None
    kv_cache_dtype: str = "auto"  # how pages are stored (jserve.kernels.kv_quant)
    quantization: str = "none"    # weight-only quantization (jserve.model.quant)
    choices: list["StorageChoice"] = dataclasses.field(default_factory=list)
    window: int | None = None     # the sliding window pages are freed by (None: all kept)
    max_chunk: int = 1            # the most tokens a step computes for one request
    # Two KV layer groups (jserve.cache.hybrid): the windowed layers' pool, its page's bytes
    # (``kv_bytes_per_page`` and ``num_kv_pages`` are then the full-attention layers') and
    # the window their passed pages are freed by. None: one group.
    local_kv_pages: int | None = None
    local_kv_bytes_per_page: int = 0
    local_window: int | None = None

    def request_kv_bytes(self, length: int) -> int:
        """KV bytes a request of ``length`` tokens holds at most (every group's pages)."""
        local = (0 if self.local_window is None else self.local_kv_bytes_per_page
                 * held_pages(length, self.page_size, self.local_window, self.max_chunk))
        return self.pages_per_request(length) * self.kv_bytes_per_page + local

    def pages_per_request(self, length: int) -> int:
        """The most pages a request of ``length`` tokens holds at once (``held_pages``)."""
        return held_pages(length, self.page_size, self.window, self.max_chunk)

    def requests_at_once(self, length: int | None = None) -> int:
        """How many requests of ``length`` tokens (default ``max_model_len``) the pool
        holds at once, each at its most pages."""
        length = self.max_model_len if length is None else length
        per = self.pages_per_request(length)
        fit = self.kvp * max(self.num_kv_pages - 1, 0) // per
        if self.local_window is None:
            return fit
        local = held_pages(length, self.page_size, self.local_window, self.max_chunk)
        return min(fit, max(self.local_kv_pages - 1, 0) // local)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def kv_cache_bytes(self) -> int:
        return (self.num_kv_pages * self.kv_bytes_per_page
                + (self.local_kv_pages or 0) * self.local_kv_bytes_per_page)

    @property
    def max_cached_tokens(self) -> int:
        """Tokens the pool caches at once: every group's pages but its sink."""
        return self.kvp * max(self.num_kv_pages - 1, 0) * self.page_size

    @property
    def activation_bytes(self) -> int:
        """Temporary buffers of the step or the sampler, whichever is larger (one runs at a
        time); 0 when not compiled."""
        return max(self.step.temp_bytes if self.step else 0,
                   self.sampler.temp_bytes if self.sampler else 0)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.state_bytes + self.activation_bytes

    def summary(self) -> str:
        lines = [f"memory plan: {self.model}, {self.dtype}, mesh {self.mesh} "
                 f"({self.num_devices} {self.platform} device"
                 f"{'s' if self.num_devices > 1 else ''}), per device:"]
        row = lambda k, v: lines.append(f"  {k:<26}{v}")
        active = ("" if self.active_params == self.num_params
                  else f", {_count(self.active_params)} active a token")
        row("weights", f"{_gb(self.weight_bytes)}  ({_count(self.num_params)} params{active}, "
                       f"{_gb(self.split_weight_bytes)} of it split on tp; quantization "
                       f"{self.quantization})")
        row("KV bytes per page", f"{self.kv_bytes_per_page:,} ({self.page_size} tokens, "
                                 f"kv_cache_dtype {self.kv_cache_dtype}"
            + (")" if self.local_window is None else "; the full-attention layers')"))
        row("KV pages", f"{self.num_kv_pages:,}" + (f" per kvp group x {self.kvp}" if self.kvp > 1
                                                    else "")
            + f" = {_gb(self.kv_cache_bytes)}  (budget: {self.kv_budget_source}; "
              f"cap {self.max_useful_pages + 1:,}: {self.max_num_seqs} seqs at full context)")
        seqs = self.max_cached_tokens / self.max_model_len
        row("max cached tokens", f"{self.max_cached_tokens:,}  ({seqs:.1f} sequences of "
                                 f"max_model_len {self.max_model_len:,})")
        if self.window is not None:
            per = self.pages_per_request(self.max_model_len)
            row("sliding window", f"{self.window:,} tokens: a request holds at most {per:,} "
                                  f"pages, so {self.requests_at_once():,} of max_model_len "
                                  "fit at once")
        if self.local_window is not None:
            every = self.kv_bytes_per_page + self.local_kv_bytes_per_page
            row("windowed layers' pages", f"{self.local_kv_pages:,} x "
                f"{self.local_kv_bytes_per_page:,} B, freed past the {self.local_window:,}-"
                f"token window: a request of max_model_len holds "
                f"{_gb(self.request_kv_bytes(self.max_model_len))} of KV (every page kept: "
                f"{_gb(self.pages_per_request(self.max_model_len) * every)}), so "
                f"{self.requests_at_once():,} fit at once")
        row("penalty state", _gb(self.state_bytes))
        if self.step is not None:
            d, p = self.step_shape
            row("step temp memory", f"{_gb(self.step.temp_bytes)}  (largest step: {d} decode "
                                    f"rows + {p} prefill tokens; compiled for {self.platform}"
                                    f" in {self.compile_seconds:.1f}s)")
        if self.sampler is not None:
            row("sampler temp memory", _gb(self.sampler.temp_bytes))
        if (self.step is not None and self.platform == "cpu" and self.dtype == "bfloat16"
                and self.kv_budget_source != "engine"):
            lines.append("  (temporaries as XLA:CPU compiles the step, with bf16 math in f32; "
                         "an accelerator's differ)")
        total = f"{_gb(self.total_bytes)}"
        if self.device_memory_bytes:
            total += (f" of {_gb(self.device_memory_bytes)} device memory (budget at "
                      f"memory_fraction {self.memory_fraction}: "
                      f"{_gb(self.device_memory_bytes * self.memory_fraction)})")
        row("total", total)
        lines.extend(self._choices_table())
        if self.fits:
            lines.append("FITS")
        else:
            lines.extend(f"DOES NOT FIT: {p}" for p in self.problems)
        return "\n".join(lines)

    def _choices_table(self) -> list[str]:
        if not self.choices:
            return []
        lines = ["  weight and KV cache storage choices, same memory (activations as compiled "
                 "for this plan, marked *; tokens the KV budget holds, uncapped):",
                 f"    {'weights':<8}{'kv cache':<10}{'weights/dev':>13}{'KV B/token':>12}"
                 f"{'cached tokens':>16}{'vs this':>9}"]
        for c in self.choices:
            mine = (c.quantization, c.kv_cache_dtype) == (self.quantization,
                                                          self.kv_cache_dtype)
            this = next((x.max_cached_tokens for x in self.choices
                         if (x.quantization, x.kv_cache_dtype) == (self.quantization,
                                                                   self.kv_cache_dtype)), 0)
            ratio = f"{c.max_cached_tokens / this:.2f}x" if this else "-"
            lines.append(f"  {'*' if mine else ' '} {c.quantization:<8}{c.kv_cache_dtype:<10}"
                         f"{_gb(c.weight_bytes):>13}{c.kv_bytes_per_token:>12,}"
                         f"{c.max_cached_tokens:>16,}{ratio:>9}")
        return lines

    def log_line(self) -> str:
        """The plan in one line (what the engine logs at start)."""
        temp = (f", step temp {_gb(self.step.temp_bytes)}" if self.step is not None else "")
        mem = (f" of {_gb(self.device_memory_bytes)}" if self.device_memory_bytes else "")
        return (f"memory per device (mesh {self.mesh}): weights {_gb(self.weight_bytes)}, "
                f"KV {self.num_kv_pages:,} pages x {self.kv_bytes_per_page:,} B "
                f"({self.kv_cache_dtype}) = "
                f"{_gb(self.kv_cache_bytes)}, max cached tokens {self.max_cached_tokens:,} "
                f"(max_model_len {self.max_model_len:,})"
                + (f", sliding window {self.window:,}: {self.requests_at_once():,} requests "
                   "of max_model_len at once" if self.window is not None else "")
                + (f", windowed layers {self.local_kv_pages:,} pages x "
                   f"{self.local_kv_bytes_per_page:,} B (window {self.local_window:,}): "
                   f"{self.requests_at_once():,} requests of max_model_len at once"
                   if self.local_window is not None else "")
                + f"{temp}; total {_gb(self.total_bytes)}"
                f"{mem}" + ("" if self.fits else "; DOES NOT FIT: " + " ".join(self.problems)))


# XLA:CPU has no bf16 matmul: it computes in f32, and loop-invariant code motion would hoist
# an f32 copy of every stacked bf16 weight out of the layer loop (34 GB of "temporaries" per
# device for Llama-3.1-70B at tp=8) where an accelerator reads the weights as they are.
# With the pass off the copies are one layer's, a small overestimate.
_CPU_COMPILE_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def kv_budget_bytes(device_memory_bytes: int, memory_fraction: float, reserved_bytes: int) -> int:
    """The plan's KV budget: the device's share minus what must sit beside the pages."""
    return int(device_memory_bytes * memory_fraction) - reserved_bytes


def _num_pages(config: EngineConfig, geo: Geometry, per_page: int,
               budget: int | None) -> int:
    """Pages per device as ``num_pages_for_budget`` counts them (0 when under 2)."""
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if budget is None:
        budget = config.kv_cache_bytes
    pages = min(max(budget, 0) // per_page, geo.max_useful_pages + 1)
    return int(pages) if pages >= 2 else 0


def _pool(cfg: ModelConfig, config: EngineConfig, geo: Geometry, per_page: int,
          budget: int | None, platform: str) -> dict:
    """The plan's pool fields: one group's pages (``_num_pages``), or two KV layer groups'
    (``jserve.engine.build.kv_groups``, where the engine would run them) from the same budget."""
    mc = geo.mesh_config
    mode = config.layer_mode(cfg.num_hidden_layers, mc.spp, platform,
                             windowed=local_window(cfg) is not None)
    window = group_window(cfg, config, mesh_size=mc.size, layer_mode=mode, warn=False)
    if window is None:
        return dict(kv_bytes_per_page=per_page,
                    num_kv_pages=_num_pages(config, geo, per_page, budget))
    num_global, num_local = layer_counts(cfg)
    per_layer = per_page // cfg.num_hidden_layers
    layer_pages = None if config.num_kv_pages is not None else max(
        config.kv_cache_bytes if budget is None else budget, 0) // per_layer
    glob, local = pool_sizes(cfg, config, window, geo.max_model_len, geo.max_chunk,
                             layer_pages)
    return dict(kv_bytes_per_page=num_global * per_layer, num_kv_pages=glob,
                local_kv_pages=local, local_kv_bytes_per_page=num_local * per_layer,
                local_window=window)


def _suggest_tp(cfg: ModelConfig, mc: MeshConfig, split: int, repl: int, other: int,
                budget: int) -> int | None:
    """The smallest larger tp the model can be split by whose weights (split part scaled)
    plus ``other`` fit ``budget``: a first guess (activations shrink too)."""
    for tp in (2 ** k for k in range(1, 11)):
        if tp <= mc.tp:
            continue
        try:
            dataclasses.replace(mc, tp=tp).validate(cfg)
        except ValueError:
            continue
        if split * mc.tp / tp + repl + other <= budget:
            return tp
    return None


# The storage choices the plan compares (fp8_e5m2 stores as many bytes as fp8_e4m3).
CHOICES = tuple((q, kv) for q in ("none", "int8", "fp8") for kv in ("auto", "int8", "fp8_e4m3"))


def plan(cfg: ModelConfig, engine_config: EngineConfig = EngineConfig(),
         device_memory_bytes: int | None = None, devices: Sequence[jax.Device] | None = None,
         model_name: str | None = None, compile: bool = True) -> MemoryPlan:
    """The memory plan of serving ``cfg`` (weights stored as its ``quantization``) with
    ``engine_config`` on ``devices`` (default ``jax.devices()``; the mesh takes the first
    ones), each with ``device_memory_bytes`` (default: the first device's, as the engine reads
    it), and what each storage choice (``CHOICES``) caches in the same budget. Nothing is
    allocated, no weight read; ``compile=False`` skips lowering (no activation memory)."""
    geo = engine_geometry(cfg, engine_config)
    mc = geo.mesh_config
    devices = list(jax.devices() if devices is None else devices)
    if mc.size > len(devices):
        raise ValueError(f"mesh {engine_config.mesh!r} needs {mc.size} devices, have "
                         f"{len(devices)} (jserve plan --devices {mc.size} simulates them "
                         "on the CPU)")
    mesh = make_mesh(mc, devices) if mc.size > 1 else None
    if device_memory_bytes is None:
        device_memory_bytes = available_device_bytes(devices[0])
    params = abstract_params(cfg, mesh, devices[0], pool_size(engine_config.lora))
    weights = per_device_bytes(params)  # the LoRA pool's with them
    split, repl = _split_bytes(params)
    per_page = kv_bytes_per_page(cfg, engine_config.page_size, kv_heads_per_device(cfg, mc.tp),
                                 cfg.num_hidden_layers // mc.spp, engine_config.kv_cache_dtype)
    rows = engine_config.max_num_seqs + geo.buckets.prefill_rows + 1
    state = per_device_bytes(state_spec(cfg, rows))
    source = ("num_kv_pages" if engine_config.num_kv_pages is not None else
              "kv_cache_bytes" if engine_config.kv_cache_bytes is not None else "device memory")

    # The step's temporaries do not grow with the pool (the pages are donated and updated in
    # place; attention gathers by the page table, whose width is max_model_len's), so one
    # compile at the smallest pool, 2 pages a group, gives them before the pool is sized.
    # (XLA:CPU scatters a bf16 pool through an f32 copy of all of it, a temporary an
    # accelerator does not make, which the small pool keeps out; see _CPU_COMPILE_OPTIONS.)
    t0 = time.perf_counter()
    shape, step, sampler = (_compile_largest_step(cfg, engine_config, geo, params, mesh,
                                                  devices[0])
                            if compile else (None, None, None))
    seconds = time.perf_counter() - t0
    act = max(step.temp_bytes if step else 0, sampler.temp_bytes if sampler else 0)
    budget = (kv_budget_bytes(device_memory_bytes, engine_config.memory_fraction,
                              weights + state + act) if source == "device memory" else None)
    pool = _pool(cfg, engine_config, geo, per_page, budget, devices[0].platform)
    p = MemoryPlan(
        model=model_name or (f"Llama {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}"),
        mesh=engine_config.mesh, num_devices=mc.size, platform=devices[0].platform,
        dtype=cfg.dtype, num_params=num_params(cfg), active_params=active_params(cfg),
        weight_bytes=weights, split_weight_bytes=split, **pool, kvp=mc.kvp,
        page_size=engine_config.page_size, max_model_len=geo.max_model_len,
        max_num_seqs=engine_config.max_num_seqs, max_useful_pages=geo.max_useful_pages,
        pages_per_group=geo.buckets.pages_per_group if mc.kvp > 1 else None,
        state_bytes=state, step_shape=shape, step=step, sampler=sampler,
        device_memory_bytes=device_memory_bytes, memory_fraction=engine_config.memory_fraction,
        kv_budget_source=source, compile_seconds=seconds,
        kv_cache_dtype=engine_config.kv_cache_dtype, quantization=cfg.quantization,
        window=geo.window, max_chunk=geo.max_chunk)
    p.choices = [_choice(cfg, engine_config, geo, mesh, devices[0], q, kv, state + act,
                         device_memory_bytes, source) for q, kv in CHOICES]
    _check(p, cfg, mc, split, repl)
    return p


def _choice(cfg: ModelConfig, engine_config: EngineConfig, geo: Geometry, mesh, device,
            quantization: str, kv_cache_dtype: str, other_bytes: int, device_memory_bytes: int,
            source: str) -> StorageChoice:
    """What the plan's budget buys with weights stored as ``quantization`` and KV pages as
    ``kv_cache_dtype`` (the rest of the plan, its activations included, unchanged)."""
    mc = geo.mesh_config
    weights = per_device_bytes(abstract_params(
        dataclasses.replace(cfg, quantization=quantization), mesh, device,
        pool_size(engine_config.lora)))
    per_page = kv_bytes_per_page(cfg, engine_config.page_size, kv_heads_per_device(cfg, mc.tp),
                                 cfg.num_hidden_layers // mc.spp, kv_cache_dtype)
    budget = (kv_budget_bytes(device_memory_bytes, engine_config.memory_fraction,
                              weights + other_bytes) if source == "device memory" else None)
    # What the budget holds, not capped at max_num_seqs x max_model_len as the pool is.
    if engine_config.num_kv_pages is not None:
        pages = engine_config.num_kv_pages
    else:
        budget = engine_config.kv_cache_bytes if budget is None else budget
        pages = max(budget, 0) // per_page
    return StorageChoice(quantization, kv_cache_dtype, weights, per_page // engine_config.page_size,
                  pages, mc.kvp * max(pages - 1, 0) * engine_config.page_size)


def _compile_largest_step(cfg: ModelConfig, engine_config: EngineConfig, geo: Geometry,
                          params, mesh, device) -> tuple:
    """(shape, step memory, sampler memory) of the largest bucket, compiled abstractly."""
    kv = abstract_kv_cache(cfg, 2, engine_config.page_size, mesh, device,
                           engine_config.kv_cache_dtype)
    spp = 1 if mesh is None else mesh.shape["spp"]
    mode = engine_config.layer_mode(cfg.num_hidden_layers, spp, device.platform,
                                    windowed=local_window(cfg) is not None)
    runner = ModelRunner(cfg, params, kv, geo.buckets, engine_config.max_num_seqs,
                         engine_config.attention_impl, mesh,
                         ProgramModes(**layer_flags(mode)), abstract=True)
    shape = (geo.buckets.decode_rows[-1], geo.buckets.prefill_tokens[-1])
    options = _CPU_COMPILE_OPTIONS if device.platform == "cpu" else None
    lowering = runner.programs.lowering
    return (shape, CompiledMemory.of(lowering.lower(shape)[0].compile(options)),
            CompiledMemory.of(lowering.lower_sampler().compile(options)))


def _check(p: MemoryPlan, cfg: ModelConfig, mc: MeshConfig, split: int, repl: int) -> None:
    """Fills ``p.problems`` with what does not fit and what to change."""
    fixed = p.weight_bytes + p.state_bytes + p.activation_bytes
    share = int(p.device_memory_bytes * p.memory_fraction) if p.device_memory_bytes else None
    if share is not None and fixed > share:
        p.suggested_tp = _suggest_tp(cfg, mc, split, repl, p.state_bytes + p.activation_bytes,
                                     share)
        more_tp = (f"tp={p.suggested_tp} (about {_gb(split * mc.tp / p.suggested_tp + repl)} "
                   "of weights per device)" if p.suggested_tp else "more tensor parallelism")
        p.problems.append(
            f"weights ({_gb(p.weight_bytes)}) + penalty state and activations "
            f"({_gb(p.state_bytes + p.activation_bytes)}) exceed the "
            f"{_gb(share)} per device that memory_fraction {p.memory_fraction} of "
            f"{_gb(p.device_memory_bytes)} allows: use {more_tp}, a larger memory_fraction, "
            "or smaller max_num_seqs / max_num_batched_tokens (activations)")
        return
    if p.num_kv_pages < 2:
        p.problems.append(
            f"the KV budget left per device holds fewer than 2 pages of {p.kv_bytes_per_page:,} "
            "bytes: use more tp, a larger memory_fraction, or smaller max_num_seqs / "
            "max_num_batched_tokens")
        return
    need = p.pages_per_request(p.max_model_len)
    alloc = PageAllocator(p.num_kv_pages, p.page_size, groups=p.kvp,
                           pages_per_group=p.pages_per_group)
    if not alloc.can_ever_hold(need) or p.local_window is not None and held_pages(
            p.max_model_len, p.page_size, p.local_window, p.max_chunk) > p.local_kv_pages - 1:
        p.problems.append(
            f"the KV pool caches {p.max_cached_tokens:,} tokens, fewer than one sequence of "
            f"max_model_len {p.max_model_len:,}: lower max_model_len, use more tp (or kvp), or "
            "give the KV cache more memory")
    if (p.kv_budget_source != "device memory" and p.device_memory_bytes
            and p.total_bytes > p.device_memory_bytes):
        p.problems.append(
            f"weights, KV cache ({p.kv_budget_source}) and activations need "
            f"{_gb(p.total_bytes)} of {_gb(p.device_memory_bytes)} per device: lower "
            f"{p.kv_budget_source} or use more tp")


def describe_engine(engine) -> str:
    """One log line with the plan's numbers for a built ``LLMEngine`` (its real arrays, pool
    and, when compiled, its largest step's ``memory_analysis()``): call it at the end of
    ``LLMEngine.__init__``, e.g. ``log.info("%s", describe_engine(self))``."""
    runner, alloc, config = engine.runner, engine.allocator, engine.config
    mc = MeshConfig.parse(config.mesh)
    cfg = engine.model_config
    step = None
    shape = None
    programs = runner.programs
    if programs.steps:
        shape = max(list(programs.steps), key=sum)
        step = CompiledMemory.of(programs.steps[shape][0])
    big_sampler = programs.samplers.get(programs.sample_rows)
    sampler = CompiledMemory.of(big_sampler) if big_sampler is not None else None
    split, _ = _split_bytes(runner.params)
    per_page = kv_bytes_per_page(cfg, config.page_size, kv_heads_per_device(cfg, mc.tp),
                                 cfg.num_hidden_layers // mc.spp, config.kv_cache_dtype)
    pool = dict(kv_bytes_per_page=per_page, num_kv_pages=alloc.pool_pages)
    local = getattr(alloc, "local", None)  # two KV layer groups (jserve.cache.hybrid)
    if local is not None:
        (num_global, num_local), per_layer = layer_counts(cfg), per_page // cfg.num_hidden_layers
        pool = dict(kv_bytes_per_page=num_global * per_layer, num_kv_pages=alloc.pool_pages,
                    local_kv_pages=local.pool_pages, local_window=alloc.local_window,
                    local_kv_bytes_per_page=num_local * per_layer)
    p = MemoryPlan(
        model=f"Llama {cfg.num_hidden_layers} layers", mesh=config.mesh, num_devices=mc.size,
        platform=jax.devices()[0].platform, dtype=cfg.dtype, num_params=num_params(cfg),
        active_params=active_params(cfg), weight_bytes=per_device_bytes(runner.params),
        split_weight_bytes=split,
        **pool, kvp=alloc.groups, page_size=config.page_size,
        max_model_len=engine.max_model_len, max_num_seqs=config.max_num_seqs,
        max_useful_pages=config.max_num_seqs * (alloc.pages_per_group or
                                                alloc.pages_held(engine.max_model_len)),
        pages_per_group=alloc.pages_per_group,
        state_bytes=per_device_bytes(runner.state), step_shape=shape, step=step,
        sampler=sampler, device_memory_bytes=None, memory_fraction=config.memory_fraction,
        kv_budget_source="engine", kv_cache_dtype=config.kv_cache_dtype,
        quantization=cfg.quantization, window=alloc.window, max_chunk=alloc.max_chunk)
    return p.log_line()


def startup_summary(engine, cache_hits: int | None) -> str:
    """What a server says when its engine is up (this stops the start's clock): where the
    start went (``StartupTimes.line``), the plan's numbers (``describe_engine``), what
    compiles later, prefix caching."""
    engine.startup.done()
    programs, mode = engine.runner.programs, engine.config.warmup
    later = {"none": "each step shape compiles on first use",
             "all": "nothing compiles later"}.get(
        mode, "other step shapes compile in the background, padded up to a compiled shape "
              "meanwhile" + (" (all queued now)" if programs.deferred is not None
                             and mode == "background" else " (on first use)")
        + ("" if programs.deferred is None or programs.spp > 1 else
           ", the sampling executable (steps whose structured-output masks come late) "
           "right after start"))
    return (f"engine {engine.startup.line()}; {describe_engine(engine)}; warmup {mode}: "
            f"{programs.compiled_up_front} programs before ready, {later}"
            + ("" if cache_hits is not None else " (warmup off)")
            + f"; prefix caching {'on' if engine.allocator.prefix_caching else 'off'}")

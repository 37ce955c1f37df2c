"""The model runner: the device state of the model step (params, KV pages, penalty state,
pipeline carry) and the execution of steps on it. Its programs, compiled ahead of time per
bucket with a compile counter tests read, are ``compiled.StepPrograms`` (lowered by
``lowering``, from the device functions of ``step_program``); KV pages move to the host and
back through ``page_io``. A plain step samples in its own executable; a pipeline tick or
pass (spp > 1) and a step whose masks come late run the shared sampling executable after
the forward. (The name follows vLLM's ``ModelRunner``; it is the only ``runner`` module in
the package.)"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Sequence

import jax
import numpy as np

from jserve.cache.pool import KVCache
from jserve.config import ModelConfig
from jserve.engine.batch.arrays import (
    SampleInputs,
    StepArrays,
    abstract_of,
    new_state,
    sample_inputs,
    state_spec,
)
from jserve.engine.batch.buckets import Buckets
from jserve.engine.device import page_io
from jserve.engine.programs.compiled import StepPrograms
from jserve.engine.programs.lowering import ProgramModes, StepLowering
from jserve.engine.programs.step_program import runtime_params
from jserve.model.params import Params
from jserve.sampling.params import MAX_LOGPROBS
from jserve.sampling.sampler import SampleResult
from sharding import pipeline
from sharding.distributed import Launch

log = logging.getLogger(__name__)


def _check_capture_layer(cfg: ModelConfig, layer: int | None, mesh) -> None:
    if layer is None:
        return
    if mesh is not None:
        raise ValueError("capturing a layer's hidden state (length probe) runs on one "
                         "device only, not with a tensor-parallel mesh")
    if not 0 <= layer <= cfg.num_hidden_layers:  # the last: the final norm's output
        raise ValueError(f"capture layer must be in [0, {cfg.num_hidden_layers}], "
                         f"got {layer}")


class ModelRunner:
    """Holds the device state and runs steps. With a ``mesh`` the params are split for tensor
    parallelism (``sharding.specs``) and ``kv_cache`` must come from
    ``allocate_sharded_kv_cache`` on it; the step's inputs, penalty state and sampling are
    replicated. With ``spp > 1`` on the mesh each step is a pipeline tick
    (``sharding.pipeline``): params and pages are split by stage, swapping is unsupported.
    ``programs``: the compiled programs (``compiled``, ``warmup``, ``defer``, counters)."""

    def __init__(self, cfg: ModelConfig, params: Params, kv_cache: KVCache, buckets: Buckets,
                 max_num_seqs: int, attention_impl: str, mesh: jax.sharding.Mesh | None = None,
                 modes: ProgramModes | None = None, params_placed: bool = False,
                 abstract: bool = False, unroll_layers: bool = False):
        """``modes``: how the programs are built (``ProgramModes``: a length probe's
        capture, the layer mode's slicing or in-place reads, decode bursts).
        ``params_placed``: ``params`` are already in the runtime layout, tp-laid-out and
        placed on ``mesh`` (a loader that streams them there, ``jserve.model.weights``).
        ``abstract``: ``params`` (runtime layout, placed) and ``kv_cache`` are
        ``jax.ShapeDtypeStruct``s and so is the penalty state: the runner only lowers and
        compiles (``programs``), nothing is allocated, until ``attach``.
        ``unroll_layers`` (params not placed): lay the layers out as separate per-layer
        weight arrays instead of stacked ones (``jserve.model.decoder.unstack_layers``; with
        spp each stage's own layers, ``sharding.pipeline.unstack_stages``)."""
        modes = modes or ProgramModes()
        _check_capture_layer(cfg, modes.capture_layer, mesh)
        self.model_config, self.mesh, self.attention_impl = cfg, mesh, attention_impl
        self.capture_layer, self.slice_layers = modes.capture_layer, modes.slice_layers
        self.last_capture = None  # the latest step's Capture (device arrays) when capturing
        # The latest plain step's PromptLogprobs (device arrays; zeros unless it asked).
        self.last_prompt_logprobs = None
        self._replicated = (None if mesh is None else
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        self._multi_process = mesh is not None and mesh.is_multi_process
        # Stream pipeline: every call of the step is one tick; ``start_pipeline`` fills the
        # carry.
        self.spp = mesh.shape["spp"] if mesh is not None else 1
        self.carry: pipeline.PipelineCarry | None = None
        self.params = params if abstract else runtime_params(
            cfg, params, mesh, placed=params_placed, unroll=unroll_layers)
        self.kv_cache = kv_cache
        rows = max_num_seqs + buckets.prefill_rows + 1
        self.state = (state_spec(cfg, rows, self._replicated) if abstract
                      else new_state(cfg, rows, self._replicated))
        self.state_sink = rows - 1
        self._spares: dict[int, jax.Array] = {}  # rows -> the plain step's logits buffer
        self._no_masks: dict[tuple[int, int], jax.Array] = {}  # ``all_allowed``
        self.executed: collections.Counter = collections.Counter()  # steps run per shape
        self.passed: collections.Counter = collections.Counter()  # lone passes per shape
        self.programs = StepPrograms(StepLowering(
            cfg, buckets, max_num_seqs, attention_impl, mesh,
            abstract_of((self.params, self.kv_cache, self.state)), modes))

    def attach(self, params: Params, kv_cache: KVCache) -> bool:
        """The real weights (the step's layout, placed) and KV pages of a runner built on
        their specs (``abstract=True``, so its programs compiled while they loaded), and a
        new penalty state. False when they differ from the specs in a way the programs
        see: then the programs are dropped, to compile again."""
        self.params, self.kv_cache = params, kv_cache
        self.state = new_state(self.model_config, self.state_sink + 1, self._replicated)
        same = self.programs.reset(abstract_of((params, kv_cache, self.state)))
        if not same:
            log.warning("loaded weights or KV pages differ from the specs the programs "
                        "were compiled for; compiling again")
        return same

    def buffer_shapes(self, shape: tuple[int, int], launch: Launch = Launch.STEP
                      ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The packed buffers and bitmask ``execute_packed`` takes for ``shape``
        (``StepPrograms``)."""
        return self.programs.buffer_shapes(shape, launch)

    # -- running steps -------------------------------------------------------------------
    def execute(self, shape: tuple[int, int], arrays: StepArrays) -> SampleResult:
        """One unpipelined step (spp == 1) of ``arrays``."""
        return self.execute_packed(shape, *self.programs.compiled(shape)[1].pack(arrays))

    def execute_packed(self, shape: tuple[int, int], ibuf, fbuf, masks=None,
                       launch: Launch = Launch.STEP) -> SampleResult | SampleInputs:
        """The step on already packed buffers (``buffer_shapes``; what multi-process
        followers receive), run as ``launch`` says (``Launch``: each way and its result).
        ``masks``: the step's bitmask (a tick's: the last row's batch's), None when no row
        has one (``PackedLayout.pack``): then nothing vocabulary-sized is sent. An
        all-decode shape's step built for decode bursts (``StepLowering.modes.burst_steps``
        > 1) runs ``StepArrays.burst`` decode steps in the one call: its result's ``tokens``
        are [burst_steps, rows] (row j: step j's; the rows past the burst zeros), its
        logprobs fields None (bursts carry none)."""
        lone, defer = launch is Launch.PASS, launch is Launch.FORWARD
        exe, layout = self.programs.compiled(shape, launch)
        if lone:
            self.passed[shape] += 1
        else:
            steps = int(ibuf[layout.int_offset(".burst")]) if self.spp == 1 else 1
            if steps > 1 and (shape[1] or steps > self.programs.lowering.modes.burst_steps):
                raise ValueError(f"a decode burst of {steps} steps at shape {shape}: only an "
                                 "all-decode shape's step runs bursts, of at most "
                                 f"{self.programs.lowering.modes.burst_steps} steps")
            self.executed[shape] += steps
        rows = self.programs.lowering.rows_for(shape)  # the sampling executable's
        put = self._global
        if lone:
            logits, self.kv_cache, self.state = exe(self.params, self.kv_cache, self.state,
                                                    put(ibuf), put(fbuf))
        elif self.spp > 1:
            logits, self.kv_cache, self.state, self.carry = exe(
                self.params, self.kv_cache, self.state, self.carry, put(ibuf), put(fbuf))
            ibuf, fbuf = ibuf[-1], fbuf[-1]  # the batch leaving the last stage samples
        else:  # the step samples too (``step_program._step``)
            at = layout.int_offset(".whole_chain")
            if defer and not ibuf[at]:  # late masks: the step hands on its logits too
                ibuf = ibuf.copy()
                ibuf[at] = 1
            out, logits, self.kv_cache, self.state, self.last_prompt_logprobs, *capture = exe(
                self.params, self.kv_cache, self.state, put(ibuf), put(fbuf),
                self.all_allowed(layout.mask_shape) if masks is None else put(masks),
                self.spare_logits(rows))
            self._spares[rows] = logits
            if capture:
                self.last_capture = capture[0]
            # Beyond greedy and temperature: the sampling executable (``step_program._step``).
            if not ibuf[at]:
                return out
        if launch is Launch.NO_EXIT:
            return self._nothing_sampled()
        inputs = sample_inputs(layout.host_arrays(ibuf, fbuf, masks), logits, rows,
                               self.state_sink)
        return inputs if defer else self.sample(inputs)

    def spare_logits(self, rows: int) -> jax.Array:
        """The logits buffer the plain step writes for the sampling executable (donated,
        handed back each step; ``StepLowering.spare_spec``, ``step_program._handed_on``),
        taken from the runner: a caller that runs the step itself keeps the one it returns."""
        spare = self._spares.pop(rows, None)
        if spare is None:  # a transfer, not a program: nothing compiles while serving
            spec = self.programs.lowering.spare_spec(rows)
            spare = jax.device_put(np.zeros(spec.shape, spec.dtype), spec.sharding)
        return spare

    def _global(self, buf):
        """A host buffer as the step takes it. On a mesh spanning several processes, the
        global array every process makes from its copy of the same buffer: the runner keeps
        the host copies for what it reads itself (flags, the sampling inputs): indexing a
        global array runs a small program on every process's devices, and two processes
        each waiting inside one hung the multi-host test now and then. Else the buffer
        itself (the call transfers it)."""
        if not self._multi_process or not isinstance(buf, np.ndarray):
            return buf
        return jax.make_array_from_process_local_data(self._replicated, buf)

    def all_allowed(self, shape: tuple[int, int]) -> jax.Array:
        """The step's bitmask when no row has one: every token allowed, kept on the device
        (made once per shape, a transfer)."""
        masks = self._no_masks.get(shape)
        if masks is None:
            masks = self._no_masks[shape] = jax.device_put(np.full(shape, -1, np.int32),
                                                           self._replicated)
        return masks

    def sample(self, inputs: SampleInputs, allowed: np.ndarray | None = None) -> SampleResult:
        """The sampling executable on a forward's ``inputs``; ``allowed``: the bitmask of
        every padded row [rows, words] in place of the one the step was built with (rows:
        ``rows_for`` the step's shape)."""
        if allowed is not None:
            sb = inputs.sampling
            inputs = dataclasses.replace(inputs, sampling=dataclasses.replace(
                sb, allowed=allowed))  # the executable's own transfer: the cheapest
        if self._multi_process:
            inputs = jax.tree.map(self._global, inputs)
        out, self.state = self.programs.sampler(inputs.rows)(self.state, inputs)
        return out

    def _nothing_sampled(self) -> SampleResult:
        r, n = self.programs.sample_rows, MAX_LOGPROBS
        return SampleResult(np.zeros(r, np.int32), np.zeros(r, np.float32),
                            np.zeros((r, n), np.int32), np.zeros((r, n), np.float32))

    def start_pipeline(self) -> None:
        """A zero residual stream in every pipeline slot (the slots' steps come with each
        tick)."""
        self.carry = pipeline.empty_carry(self.mesh, self.model_config,
                                          sum(self.programs.lowering.stream_shape))

    # -- swapping KV pages to host memory and back ---------------------------------------
    def read_pages(self, pages: Sequence[int]):
        """Host copies of ``pages`` (``page_io.read_pages``; with the swap programs compiled
        at start when there are)."""
        return page_io.read_pages(self.kv_cache, pages, self.programs.movers)

    def write_pages(self, pages: Sequence[int], data) -> None:
        self.kv_cache = page_io.write_pages(self.kv_cache, pages, data, self.programs.movers)

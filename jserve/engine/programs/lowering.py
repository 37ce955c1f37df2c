"""Lowering a runner's programs: a bucket shape's step (spp > 1: tick) or pass, or the
sampling executable, traced and lowered against abstract arguments (the
params, KV pages and penalty state as ``jax.ShapeDtypeStruct``s, so a lowering never reads
an array, and a background lowering never touches arrays a step donates). Compiling them
and keeping the executables is ``compiled.StepPrograms``'s job."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jserve import backend
from jserve.cache.pool import HybridKV, formats, pages_row_major, row_major
from jserve.config import ModelConfig
from jserve.engine.batch.arrays import PackedLayout, StepArrays, arrays_spec, sample_inputs_spec
from jserve.engine.batch.buckets import Buckets
from jserve.engine.programs.step_program import StepSpec, jitted
from jserve.model.lora import pool_slots
from sharding import pipeline
from sharding.distributed import Launch


def pinned_pages(attention_impl: str, spp: int, capture_layer: int | None) -> bool:
    """Whether a runner's KV pool is pinned row-major (``pool.pages_row_major``: a TPU under
    the Pallas kernels), where its programs return the pages in that layout too; not with a
    pipeline or a length probe's capture (their programs' outputs are laid out otherwise)."""
    from jserve.kernels import resolve_impl

    return spp == 1 and capture_layer is None and pages_row_major(
        backend.current(), resolve_impl(attention_impl))


@dataclasses.dataclass(frozen=True)
class ProgramModes:
    """How a runner's programs are built, beside the model, its buckets and its mesh: what
    each bucket's ``StepSpec`` is made from (``StepLowering.step_spec``).

    - ``capture_layer``: a length probe's layer, whose prompt sums the steps return too.
    - ``slice_layers`` / ``in_place_layers``: the layer mode's (``config.layer_flags``):
      stacked weights unrolled over static slices ("sliced"), or read in place by the
      loop's matmuls (``True``: "indexed"; ``"decode"``: in the decode-only steps alone,
      "sliced-indexed").
    - ``burst_steps``: the most decode steps an all-decode shape's step runs in one call
      (1: no bursts); ``whole_chain_decodes``: those steps sample with the whole chain."""

    capture_layer: int | None = None
    slice_layers: bool = False
    in_place_layers: bool | str = False
    burst_steps: int = 1
    whole_chain_decodes: bool = False


class StepLowering:
    """The lowerings of one runner's programs. ``args``: (params, KV cache, penalty state)
    as ``ShapeDtypeStruct``s with their shardings (``arrays.abstract_of``)."""

    def __init__(self, cfg: ModelConfig, buckets: Buckets, max_num_seqs: int,
                 attention_impl: str, mesh: jax.sharding.Mesh | None, args: tuple,
                 modes: ProgramModes = ProgramModes()):
        self.model_config, self.buckets, self.mesh = cfg, buckets, mesh
        self.attention_impl = attention_impl
        # The modes as they hold here: no decode burst (1: none) with a length probe's
        # capture; with bursts, the all-decode steps sample with the whole chain, so requests
        # with filters, penalties or a bias burst too (``factory.whole_chain_decodes``: a GPU
        # or TPU, where compiles run in parallel on many cores and the host is the
        # bottleneck); without, there is nothing for it to do.
        bursts = modes.burst_steps if modes.capture_layer is None else 1
        self.modes = dataclasses.replace(
            modes, burst_steps=bursts,
            whole_chain_decodes=modes.whole_chain_decodes and bursts > 1)
        # Stream pipeline: every call of the step is one tick. Params and pages are split by
        # stage on the mesh's "spp" axis either way.
        self.spp = mesh.shape["spp"] if mesh is not None else 1
        if pinned_pages(attention_impl, self.spp, modes.capture_layer):
            args = (args[0], row_major(args[1]), args[2])
        self.args = args
        self.page_formats = formats(args[1])  # the steps return the pages as they take them
        self.replicated = (None if mesh is None else
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        self.sample_rows = buckets.max_rows
        # Speculative decoding widens the decode buckets (1 + k rows a decode); steps within
        # the rows of plain decoding keep a sampler of that size (``rows_for``), so they pay
        # nothing for the option. Without drafts both sizes are the same.
        self.plain_rows = min(max_num_seqs + buckets.prefill_rows, buckets.max_rows)
        self.page_size = jax.tree.leaves(args[1])[0].shape[3]
        self.jitted = jitted(self.spp, self.page_formats)
        self._layouts: dict[tuple[int, int], PackedLayout] = {}

    @property
    def stream_shape(self) -> tuple[int, int]:
        """The pipeline carry's canonical rows (``sharding.pipeline``): the most decode rows
        of any bucket, then the largest prefill chunk."""
        b = self.buckets
        return max(b.decode_rows + b.decode_only_rows), b.prefill_tokens[-1]

    def arrays_spec(self, num_decodes: int, num_prefill_tokens: int) -> StepArrays:
        """Abstract shapes of a bucket's inputs (what ``StepBuilder`` fills)."""
        return arrays_spec(self.buckets, self.model_config.vocab_size, num_decodes,
                           num_prefill_tokens, isinstance(self.args[1], HybridKV),
                           lora=pool_slots(self.args[0]["layers"]) > 0)

    def rows_for(self, shape: tuple[int, int]) -> int:
        """The rows a step of ``shape`` pads its sampling inputs to."""
        rows = shape[0] + (self.buckets.prefill_rows if shape[1] else 0)
        return self.plain_rows if self.spp == 1 and rows <= self.plain_rows \
            else self.sample_rows

    def spare_spec(self, rows: int) -> jax.ShapeDtypeStruct:
        """The logits buffer [vocab, ``rows``] a plain step writes for the sampling
        executable when it samples the step again (``step_program._handed_on``)."""
        return jax.ShapeDtypeStruct((self.model_config.vocab_size, rows), jnp.float32,
                                    sharding=self.replicated)

    def buffer_shapes(self, layout: PackedLayout, launch: Launch = Launch.STEP
                      ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The packed int32 and float32 buffers of a step laid out by ``layout``: one step's,
        or with spp > 1 one per pipeline slot ([spp, size]) unless ``launch`` is a pass; and
        its bitmask (a tick's: the batch leaving the last stage's)."""
        lead = (self.spp,) if self.spp > 1 and launch is not Launch.PASS else ()
        return lead + (layout.int_size,), lead + (layout.float_size,), layout.mask_shape

    def layout(self, shape: tuple[int, int]) -> PackedLayout:
        """A bucket's ``PackedLayout``, made once (the builder packs steps with it)."""
        layout = self._layouts.get(shape)
        if layout is None:  # the compile thread and the engine's may both ask
            layout = self._layouts.setdefault(shape, PackedLayout(self.arrays_spec(*shape)))
        return layout

    def _buffer_specs(self, shape: tuple[int, int], launch: Launch = Launch.STEP
                      ) -> tuple[PackedLayout, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct,
                                 jax.ShapeDtypeStruct]:
        """A bucket's layout, its packed int32 and float32 buffers and its bitmask (the
        plain step's argument), abstract."""
        layout = self.layout(shape)
        return (layout, *(jax.ShapeDtypeStruct(s, dtype, sharding=self.replicated)
                          for s, dtype in zip(self.buffer_shapes(layout, launch),
                                              (jnp.int32, jnp.float32, jnp.int32))))

    def step_spec(self, shape: tuple[int, int], launch: Launch = Launch.STEP,
                  burst_steps: int | None = None) -> StepSpec:
        """What the program running ``launch`` (``Launch.PASS``: the pass, spp > 1; any
        other: the step, spp > 1: the tick) of bucket ``shape`` is compiled
        for; ``burst_steps``: in place of the runner's (a benchmark's plain decode step: 1)."""
        modes = self.modes
        burst_steps = modes.burst_steps if burst_steps is None else burst_steps
        in_place = modes.in_place_layers is True or (modes.in_place_layers == "decode"
                                                     and shape[1] == 0)
        spec = StepSpec(self.layout(shape), self.model_config, self.attention_impl, self.mesh,
                        self.rows_for(shape), in_place_layers=in_place)
        if launch is Launch.PASS:
            return spec
        if self.spp > 1:
            return dataclasses.replace(spec, decode_rows=self.stream_shape[0])
        spec = dataclasses.replace(spec, capture_layer=modes.capture_layer,
                                   slice_layers=modes.slice_layers and not in_place)
        if burst_steps > 1 and shape[1] == 0:
            spec = dataclasses.replace(spec, burst_steps=burst_steps, page_size=self.page_size,
                                       whole_chain=modes.whole_chain_decodes)
        return spec

    def lower(self, shape: tuple[int, int], launch: Launch = Launch.STEP,
              burst_steps: int | None = None) -> tuple[jax.stages.Lowered, PackedLayout]:
        """The program running ``launch`` (``step_spec``) of bucket ``shape``, and its
        layout."""
        spec = self.step_spec(shape, launch, burst_steps)
        layout, ibuf, fbuf, masks = self._buffer_specs(shape, launch)
        args = self.args
        if launch is Launch.PASS:
            lowered = self.jitted.lone.lower(*args, ibuf, fbuf, spec=spec)
        elif self.spp == 1:
            lowered = self.jitted.step.lower(*args, ibuf, fbuf, masks,
                                             self.spare_spec(spec.rows), spec=spec)
        else:
            carry = pipeline.carry_spec(self.mesh, self.model_config, sum(self.stream_shape))
            lowered = self.jitted.step.lower(*args, carry, ibuf, fbuf, spec=spec)
        return lowered, layout

    def lower_sampler(self, rows: int | None = None) -> jax.stages.Lowered:
        """The sampling program, on the padded rows every step hands it (the largest step's
        unless ``rows``)."""
        # One device: the KV pages' (so a target's compile-only device, not JAX's default).
        placed = self.replicated or jax.tree.leaves(self.args[1])[0].sharding
        spec = sample_inputs_spec(rows or self.sample_rows, self.model_config.vocab_size,
                                  placed)
        return self.jitted.sample.lower(self.args[2], spec)

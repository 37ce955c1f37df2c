"""The device side of a step, as pure functions jitted per runner (``jitted``): the fused
plain step (forward, penalty state, sampling; an all-decode shape's runs decode bursts
too), a stream-pipeline tick and lone pass, and the sampling executable every shape
shares; ``runtime_params`` puts the params in the layout they take."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jserve import backend as jserve_backend
from jserve.cache.pool import KVCache
from jserve.config import ModelConfig
from jserve.engine.batch import burst
from jserve.engine.batch.arrays import (
    PackedLayout,
    SampleInputs,
    SeqState,
    StepArrays,
    sample_inputs,
)
from jserve.engine.requests import prompt_logprobs
from jserve.model import lora_pool
from jserve.model.decoder import (
    Params,
    final_logits,
    forward_stream,
    to_runtime_layout,
    unstack_layers,
)
from jserve.model.layer_weights import reading_in_place
from jserve.sampling.params import MAX_LOGPROBS
from jserve.sampling.sampler import (
    SampleResult,
    apply_bias,
    apply_penalties,
    choose_tokens,
    plain_greedy,
    temperature_only,
    temperature_tokens,
    token_logprobs,
    vocab_argmax,
)
from sharding import pipeline
from sharding.specs import param_specs, shard_params
from sharding.tensor_parallel import tp_forward


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What one step program is compiled for: static under ``jax.jit`` (hashed, so one
    spec is one program). ``layout``: the bucket's packed buffers; ``rows``: the sampling
    rows it pads to (``StepLowering.rows_for``). The modes, each read by one stage:

    - ``capture_layer``: the prompt sums of that layer's input come out too (a length
      probe's ``Capture``); None compiles exactly the step without it.
    - ``slice_layers``: stacked params, the layers unrolled over static slices of them
      (``EngineConfig.layer_loop`` "sliced": on GPU neither the loop's weight copies nor an
      argument per layer weight).
    - ``in_place_layers``: the loop's matmuls read each layer of the stacked weights in
      place (``layer_loop`` "indexed", ``jserve.model.layer_weights``).
    - ``burst_steps`` > 1 (an all-decode shape, ``jserve.engine.batch.burst``): the step
      loops over up to that many decode steps; ``page_size`` is what it advances by, and
      ``whole_chain`` samples every step with the whole chain (a GPU or TPU's all-decode
      shapes, ``StepLowering.modes.whole_chain_decodes``).
    - ``decode_rows`` (spp > 1): the pipeline carry's decode rows (``sharding.pipeline``).
    """

    layout: PackedLayout
    cfg: ModelConfig
    attention_impl: str
    mesh: jax.sharding.Mesh | None
    rows: int
    capture_layer: int | None = None
    slice_layers: bool = False
    in_place_layers: bool = False
    burst_steps: int = 1
    page_size: int = 0
    whole_chain: bool = False
    decode_rows: int = 0


def _update_state(state: SeqState, tokens, rows, is_prompt, reset_rows, on=True) -> SeqState:
    """The penalty state after a step's fed ``tokens``; ``on`` false (traced): every write
    dropped (its row index past the rows), the state unchanged."""
    n = state.output_counts.shape[0]
    sink = n - 1
    row = lambda r: jnp.where(on, r, n)
    counts = state.output_counts.at[row(reset_rows)].set(0, mode="drop")
    mask = state.prompt_mask.at[row(reset_rows)].set(False, mode="drop")
    counts = counts.at[row(rows), tokens].add(
        jnp.where(is_prompt, 0, 1).astype(counts.dtype), mode="drop")
    mask = mask.at[row(jnp.where(is_prompt, rows, sink)), tokens].set(True, mode="drop")
    return dataclasses.replace(state, output_counts=counts, prompt_mask=mask)


def _penalty_state(state: SeqState, arrays: StepArrays) -> SeqState:
    """``_update_state`` when some row of the step uses penalties (a runtime choice)."""
    args = (state, arrays.batch.tokens, arrays.token_state_rows, arrays.token_is_prompt,
            arrays.reset_rows)
    if not jserve_backend.branches_cheap():
        return _update_state(*args, on=arrays.any_penalty)
    return jax.lax.cond(arrays.any_penalty, lambda: _update_state(*args), lambda: state)


def _handed_on(logits: jax.Array, state: SeqState, arrays: StepArrays, rows: int,
               mesh: jax.sharding.Mesh | None, spare: jax.Array | None = None
               ) -> tuple[jax.Array, SeqState]:
    """The step's tail after the forward (shared by the plain step, the pipeline tick and
    the lone pass): the penalty state update, which reads the step's tokens, then the
    logits [vocab, ``rows``] for the sampling executable (the rest of its ``SampleInputs``
    the host makes from the step's buffers, ``arrays.sample_inputs``), replicated over
    ``mesh`` as that executable takes them (multi-process leaders read their own copy; the
    donated state keeps its input sharding). The plain step passes ``spare``, the donated
    buffer of its last call, and writes its logits into it only when the sampling
    executable will read them (``StepArrays.whole_chain``): padding them to ``rows`` every
    step was 5% of a batch-32 step on a 32K vocabulary, vocab x rows floats written.
    Penalty bookkeeping only when some row uses penalties (a row is reset at its
    sequence's first chunk, so skipped steps leave nothing stale that a penalised request
    reads)."""
    state = _penalty_state(state, arrays)
    if spare is None:
        handed = jnp.pad(logits, ((0, 0), (0, rows - logits.shape[1])))
    elif not jserve_backend.branches_cheap():  # in place, where a branch would copy the spare
        handed = jax.lax.dynamic_update_slice(spare, logits, (0, 0))
    else:
        handed = jax.lax.cond(
            arrays.whole_chain, lambda b: jax.lax.dynamic_update_slice(b, logits, (0, 0)),
            lambda b: b, spare)
    if mesh is None:
        return handed, state
    return jax.lax.with_sharding_constraint(
        (handed, state), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _choose(state: SeqState, inp: SampleInputs) -> jax.Array:
    """The token of every row through the whole chain. Where branches are cheap the logit
    bias only when some row has one, penalties only when some row uses them, the sort only
    when some row samples; elsewhere each step of the chain runs (a no-op, bit for bit, on
    a row that does not use it: ``apply_penalties``, ``choose_tokens``)."""
    logits, sb = inp.logits.T, inp.sampling  # the chain reads rows
    penalties = lambda x: apply_penalties(x, state.output_counts[inp.state_rows],
                                          state.prompt_mask[inp.state_rows], sb)
    if not jserve_backend.branches_cheap():
        return choose_tokens(penalties(apply_bias(logits, sb)), sb, all_greedy=False)
    biased = jax.lax.cond(inp.any_bias, lambda: apply_bias(logits, sb), lambda: logits)
    penalised = jax.lax.cond(inp.any_penalty, lambda: penalties(biased), lambda: biased)
    return jax.lax.cond(inp.any_random,
                        lambda: choose_tokens(penalised, sb, all_greedy=False),
                        lambda: choose_tokens(penalised, sb, all_greedy=True))


def _sample(state: SeqState, inp: SampleInputs) -> tuple[SampleResult, SeqState]:
    """Token choice and logprobs (one executable, or the tail of the plain step); the chosen
    tokens are kept in ``state.last_tokens`` for the next step. One run-time branch (on
    XLA:GPU one host sync) of four: a plain greedy batch (``plain_greedy``) takes the
    argmax of the vocabulary-major logits in place; a batch of greedy and temperature rows
    with nothing else ``temperature_tokens``; any other the whole chain (``_choose``,
    which reads them transposed to rows, as the logprobs do); and with logprobs (of the raw
    ``logits``) the whole chain and them. Each branch returns only its [S] results."""
    logits, sb = inp.logits, inp.sampling
    s = logits.shape[1]
    zeros = (jnp.zeros((s,), jnp.float32), jnp.zeros((s, MAX_LOGPROBS), jnp.int32),
             jnp.zeros((s, MAX_LOGPROBS), jnp.float32))
    plain = plain_greedy(sb, inp.any_bias | inp.any_penalty | inp.any_random)
    temperature = ~(inp.any_bias | inp.any_penalty) & temperature_only(sb, logits.shape[0])

    def with_logprobs():
        tokens = _choose(state, inp)
        return tokens, *token_logprobs(logits.T, tokens, MAX_LOGPROBS)

    branch = jnp.where(inp.want_logprobs, 3, jnp.where(plain, 0, jnp.where(temperature, 1, 2)))
    tokens, chosen, top_ids, top_lp = jax.lax.switch(branch, (
        lambda: (vocab_argmax(logits), *zeros),
        lambda: (temperature_tokens(logits.T, sb), *zeros),
        lambda: (_choose(state, inp), *zeros),
        with_logprobs))
    last = state.last_tokens.at[inp.sampled_state_rows].set(tokens)
    return (SampleResult(tokens, chosen, top_ids, top_lp),
            dataclasses.replace(state, last_tokens=last))


def _common_tokens(state: SeqState, inp: SampleInputs, whole_chain: jax.Array
                   ) -> tuple[SampleResult, SeqState]:
    """``_sample`` of a batch whose rows are all greedy or sample at a temperature with
    nothing else: the same tokens, no logprobs, in one run-time branch. With
    ``whole_chain`` (the sampling executable samples the step again) zeros, not a second
    set of random draws."""
    branch = jnp.where(whole_chain, 0, jnp.where(inp.any_random, 2, 1))
    tokens = jax.lax.switch(branch, (
        lambda: jnp.zeros(inp.state_rows.shape, jnp.int32),
        lambda: vocab_argmax(inp.logits),
        lambda: temperature_tokens(inp.logits.T, inp.sampling)))
    last = state.last_tokens.at[inp.sampled_state_rows].set(tokens)
    return (SampleResult(tokens, None, None, None),
            dataclasses.replace(state, last_tokens=last))


def _padded(out: SampleResult, rows: int) -> SampleResult:
    """``out`` padded with zero rows to ``rows`` (the shape the engine reads)."""
    pad = lambda a: jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    return jax.tree.map(pad, out)


def _forward_step(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array,
                  fbuf: jax.Array, *, spec: StepSpec):
    """The forward of one bucket and the penalty state update (the step without its
    sampling, for benchmarks); returns (logits [vocab, S], KV cache, state, PromptLogprobs:
    zeros unless the step asked, ``prompt_logprobs``), and with ``spec.capture_layer`` set
    a fifth output: the layer's ``Capture`` (prompt sums over the step's prompt tokens)."""
    arrays, logits, kv_cache, state, prompt, *capture = _forward(
        params, kv_cache, state, ibuf, fbuf, spec)
    state = _penalty_state(state, arrays)
    return (logits, kv_cache, state, prompt, *capture)


def _forward(params, kv_cache, state, ibuf, fbuf, spec: StepSpec, masks=None):
    """``_forward_step`` before its tail: (the step's arrays, its logits [vocab, S], KV
    cache, state, PromptLogprobs[, Capture]); ``masks``: the step's bitmask
    (``PackedLayout``; None: every token allowed)."""
    cfg, mesh, impl, capture_layer = spec.cfg, spec.mesh, spec.attention_impl, spec.capture_layer
    if spec.slice_layers:
        params = unstack_layers(params)
    arrays = spec.layout.unpack_fed(ibuf, fbuf, masks, state.last_tokens)
    with reading_in_place(spec.in_place_layers):
        if mesh is None:
            x, kv_cache, capture = forward_stream(
                params, kv_cache, arrays.batch, cfg=cfg, attention_impl=impl,
                capture_layer=capture_layer,
                prompt_mask=arrays.token_is_prompt if capture_layer is not None else None)
            logits = final_logits(params, x, arrays.batch.logits_rows, cfg, vocab_major=True)
        else:  # tensor / KV-cache parallel; the rest runs replicated on the logits
            logits, kv_cache, x = tp_forward(params, kv_cache, arrays.batch, mesh=mesh,
                                             cfg=cfg, attention_impl=impl,
                                             stream=True, vocab_major=True)
    prompt = prompt_logprobs.of_step(params, x, arrays, cfg)
    capture = (capture,) if capture_layer is not None else ()
    return (arrays, logits, kv_cache, state, prompt, *capture)


def _step(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array, fbuf: jax.Array,
          masks: jax.Array, spare: jax.Array, *, spec: StepSpec):
    """The plain step (spp == 1): the forward and the sampling in one executable, so the
    logits never leave it and the host dispatches one call a step. Returns (SampleResult,
    logits, KV cache, state, PromptLogprobs[, Capture]). Its own sampling, on its own rows,
    is ``_common_tokens`` (greedy and temperature; no logprobs, the SampleResult's other
    fields None): the rest of the chain was half of a CPU step program's compile time. A
    step that needs more (``StepArrays.whole_chain``: filters, bias, penalties, bans, masks,
    logprobs, or masks that come late, ``late_masks``) writes its logits into ``spare``
    (donated, [vocab, rows], ``_handed_on``) and the sampling executable samples it again,
    with the ``SampleInputs`` the host makes (``arrays.sample_inputs``), overwriting
    the tokens this one kept in ``state.last_tokens`` before anything reads them.
    ``masks``: the structured-output bitmask [S, vocab/32] (``PackedLayout``: all -1, kept on
    the device, when no row has one).

    ``spec.burst_steps`` > 1: the program loops over ``StepArrays.burst`` steps (1 to
    ``burst_steps``, a runtime count), each on the buffers ``burst.advance``d from the
    first; the tokens are [burst_steps, rows], row j step j's (rows past the count: zeros),
    and the other outputs the last step's (a decode-only step has no prompt logprobs:
    zeros). One program serves the shape's single steps and its bursts. With
    ``spec.whole_chain`` its steps sample with the whole chain (``_sample``: filters,
    penalties, bias, bans, masks packed with the step), so bursts take such requests too;
    only logprobs and late masks still need the sampling executable."""
    layout, rows, burst_steps = spec.layout, spec.rows, spec.burst_steps

    def one(kv, st, buf, handed):
        arrays, logits, kv, st, prompt, *capture = _forward(params, kv, st, buf, fbuf, spec,
                                                            masks)
        handed, st = _handed_on(logits, st, arrays, rows, spec.mesh, handed)
        own = sample_inputs(arrays, logits)
        out, st = (_sample(st, own) if spec.whole_chain
                   else _common_tokens(st, own, arrays.whole_chain))
        return _padded(out, rows), handed, kv, st, prompt, *capture

    if burst_steps == 1:
        return one(kv_cache, state, ibuf, spare)
    assert spec.capture_layer is None, "a burst captures nothing"
    n = jnp.clip(layout.int_leaf(ibuf, ".burst"), 1, burst_steps)
    num_decodes = layout.int_shape(".batch.tokens")[0]

    def body(j, carry):
        kv, st, tokens, handed = carry
        buf = burst.advance(layout, ibuf, j, tokens[jnp.maximum(j - 1, 0)], num_decodes,
                            spec.page_size)
        out, handed, kv, st, _ = one(kv, st, buf, handed)
        return kv, st, tokens.at[j].set(out.tokens), handed

    init = (kv_cache, state, jnp.zeros((burst_steps, rows), jnp.int32), spare)
    kv_cache, state, tokens, handed = jax.lax.fori_loop(0, n, body, init)
    return (SampleResult(tokens, None, None, None), handed, kv_cache, state,
            prompt_logprobs.zeros(num_decodes))


def _tick(params: Params, kv_cache: KVCache, state: SeqState, carry: pipeline.PipelineCarry,
          ibufs: jax.Array, fbufs: jax.Array, *, spec: StepSpec):
    """A stream-pipeline tick (``sharding.pipeline.tick``; ``ibufs``/``fbufs`` [spp, size]:
    every stage's batch at the tick's shape), then the plain step's tail on the batch that
    left the last stage (the last row; replicated, outside the shard_map). Every slot's fed
    tokens are filled in: the host resends a batch's buffers each tick, and a sequence's
    ``last_tokens`` entry does not change while its batch is in flight (its sampled chunk is
    its only one in the pipeline)."""
    layout = spec.layout
    ibufs = jax.vmap(layout.feed, in_axes=(0, None))(ibufs, state.last_tokens)
    with reading_in_place(spec.in_place_layers):  # each stage's loop (``layer_loop`` "indexed")
        kv_cache, carry = pipeline.tick(params, kv_cache, carry, ibufs, fbufs,
                                        unpack=layout.unpack, decode_rows=spec.decode_rows,
                                        mesh=spec.mesh, cfg=spec.cfg,
                                        attention_impl=spec.attention_impl)
    arrays = layout.unpack(ibufs[-1], fbufs[-1])
    x = pipeline.exiting(carry, arrays.batch.attn.num_decodes, arrays.batch.tokens.shape[0],
                         spec.decode_rows)
    logits = final_logits(params, x, arrays.batch.logits_rows, spec.cfg, vocab_major=True)
    logits, state = _handed_on(logits, state, arrays, spec.rows, spec.mesh)
    return logits, kv_cache, state, carry


def _lone_pass(params: Params, kv_cache: KVCache, state: SeqState, ibuf: jax.Array,
               fbuf: jax.Array, *, spec: StepSpec):
    """A batch alone in an empty pipeline through every stage at once
    (``sharding.pipeline.lone_pass``; ``ibuf``/``fbuf``: its own packed step, fed like the
    plain step's), then ``_tick``'s tail on the stream that left the last stage."""
    layout = spec.layout
    ibuf = layout.feed(ibuf, state.last_tokens)
    arrays = layout.unpack(ibuf, fbuf)
    with reading_in_place(spec.in_place_layers):
        kv_cache, x = pipeline.lone_pass(params, kv_cache, ibuf, fbuf, unpack=layout.unpack,
                                         mesh=spec.mesh, cfg=spec.cfg,
                                         attention_impl=spec.attention_impl)
    logits = final_logits(params, x, arrays.batch.logits_rows, spec.cfg, vocab_major=True)
    logits, state = _handed_on(logits, state, arrays, spec.rows, spec.mesh)
    return logits, kv_cache, state


def _unstacked(params: Params, mesh: jax.sharding.Mesh | None) -> Params:
    """``unstack_layers`` on placed params, each layer's arrays keeping their tp split; with
    spp > 1 ``pipeline.unstack_stages`` (each stage's layers, still split by stage)."""
    split = (unstack_layers if mesh is None or mesh.shape["spp"] == 1 else
             functools.partial(pipeline.unstack_stages, spp=mesh.shape["spp"]))
    target = jax.eval_shape(split, params)  # structure only
    shardings = (None if mesh is None else jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec), param_specs(target),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    return jax.jit(split, out_shardings=shardings)(params)


class Jitted(NamedTuple):
    """A runner's jitted programs (``jitted``)."""

    step: Callable             # spp > 1: the pipeline tick
    lone: Callable | None      # spp > 1: a batch alone through every stage; else None
    sample: Callable           # the sampling executable


def jitted(spp: int, page_formats=None) -> Jitted:
    """The runner's jitted step (spp > 1: tick), pass (spp > 1: a batch alone in an empty
    pipeline through every stage; else None) and sampler. Fresh function objects per runner:
    JAX's trace and compile caches are keyed weakly on the function, so a dropped engine's
    executables (hundreds of memory maps each on CPU) are freed with it instead of
    accumulating for the life of the process. ``page_formats`` (spp == 1, no capture): the
    pinned layouts the step returns the KV pages in (``lowering.pinned_pages``)."""
    if spp > 1:
        step = jax.jit(_fresh(_tick), static_argnames=("spec",), donate_argnums=(1, 2, 3))
        lone = jax.jit(_fresh(_lone_pass), static_argnames=("spec",), donate_argnums=(1, 2))
    else:
        pinned = {} if page_formats is None else dict(
            out_shardings=(None, None, page_formats, None, None))
        step = jax.jit(_fresh(_step), static_argnames=("spec",), donate_argnums=(1, 2, 6),
                       **pinned)
        lone = None
    return Jitted(step, lone, jax.jit(_fresh(_sample), donate_argnums=(0,)))


def _fresh(fn):
    """A new function object running ``fn`` (see ``jitted``)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return fn(*args, **kwargs)
    return run


def runtime_params(cfg: ModelConfig, params: Params, mesh: jax.sharding.Mesh | None, *,
                   placed: bool, unroll: bool, lora: tuple[int, int] | None = None) -> Params:
    """``params`` as the step takes them: the runtime layout (``to_runtime_layout``) split
    for tp on ``mesh`` unless ``placed`` already, with per-layer arrays if ``unroll``;
    ``lora`` (slots, rank): with an empty LoRA adapter pool (``jserve.model.lora``)."""
    if not placed:
        params = to_runtime_layout(params)
        if mesh is not None:
            params = shard_params(params, cfg, mesh)
    if lora is not None:
        params = {**params, "layers": {**params["layers"],
                                       **lora_pool.empty_pool(cfg, *lora, mesh)}}
    return _unstacked(params, mesh) if unroll else params



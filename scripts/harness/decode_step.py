"""The bench model's all-decode step, taken apart (``scripts/profile_step.py``,
``scripts/profile_ops.py``): an engine on the bench model (4 layers, hidden 512, GQA 8/2,
vocab 8192, f32), its all-decode steps timed as (wall, CPU) pairs, one step's packed inputs
captured and its compiled step run back to back on them (one executable, the forward and the
sampling executable, or the forward alone), and the matmul ceiling of the same weights."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from harness.bench_checkpoint import BENCH_CHECKPOINTS, bench_checkpoint
from harness.host_probes import HostPhases
from jserve.config import ModelConfig
from jserve.engine.batch.arrays import SampleInputs, sample_inputs
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.engine.programs import step_program as runner_module
from jserve.model.decoder import head_product
from jserve.model.layer_weights import MATRICES
from jserve.model.params import Params
from jserve.model.tp_layout import EXPERTS
from jserve.model.weights import init_params, load_model
from jserve.sampling import sampler as sampler_module

BENCH_MODEL = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, max_position_embeddings=4096, eos_token_ids=(2,))


CALLS = 30  # device-only step and ceiling calls per repetition


def clocks() -> np.ndarray:
    """(wall, this process's CPU time over all its threads) in seconds. CPU time moves far
    less with the neighbours' load than wall time does, so both are reported."""
    return np.array([time.perf_counter(), time.process_time()])


def bench_model(name: str = "bench") -> tuple[ModelConfig, Params]:
    """``scripts/profile_step.py --model``: "bench" (``BENCH_MODEL``, seeded random
    weights), "bench-32k" (the bench model's shape with a 32,768-token vocabulary, a HF
    checkpoint written once by transformers: ``bench_checkpoint``), or anything
    ``load_model`` takes (a built-in name, a HF or orbax directory), read as float32."""
    if name == "bench":
        return BENCH_MODEL, init_params(BENCH_MODEL)
    if name in BENCH_CHECKPOINTS:
        name = str(bench_checkpoint(BENCH_CHECKPOINTS[name]))
    cfg, params, _ = load_model(name, dtype="float32")
    return cfg, params


def bench_engine(batch: int, attention_impl: str = "auto",
                 model: tuple[ModelConfig, Params] | None = None,
                 decode_burst: int | str = "auto") -> LLMEngine:
    """The bench model's engine (or ``model``'s: ``bench_model``) sized for ``batch``
    decodes (buckets compile on first use), its step programs built for decode bursts of
    up to ``decode_burst`` steps, none taken until a timing asks (``bursts.steps``)."""
    cfg, params = model or (BENCH_MODEL, init_params(BENCH_MODEL))
    eng = LLMEngine(cfg, params, None,
                    EngineConfig(max_num_seqs=batch, max_num_batched_tokens=512,
                                 max_model_len=2048, warmup=False,
                                 attention_impl=attention_impl, decode_burst=decode_burst))
    eng.bursts.steps = 1
    return eng


def bench_prompts(batch: int, prompt_len: int, vocab: int = BENCH_MODEL.vocab_size
                  ) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, prompt_len).tolist() for _ in range(batch)]


def decode_steps(eng: LLMEngine, prompts, params, phases: HostPhases | None = None
                 ) -> list[np.ndarray]:
    """(wall, CPU) seconds of every engine step taken while every running request
    decodes."""
    for p in prompts:
        eng.add_request(p, params)
    steps = []
    if phases is not None:
        phases.runs.append([])
    while eng.has_unfinished():
        t = clocks()
        decoding = bool(eng.scheduler.running) and not eng.scheduler.waiting and all(
            r.is_decode for r in eng.scheduler.running)
        if phases is not None:
            phases.start()
        eng.step()
        if phases is not None:
            phases.stop(keep=decoding)
        if decoding:
            steps.append(clocks() - t)
    return steps[2:-2]  # drop the ramp and the tail (the last token's read step)


def burst_token_times(eng: LLMEngine, prompts, params, burst: int) -> list[np.ndarray]:
    """(wall, CPU) seconds per token of every engine step that read a whole burst of
    ``burst`` tokens of the first request (``EngineConfig.decode_burst``; under async
    scheduling such a step launched the next burst and read this one): the step's time
    over ``burst``."""
    eng.bursts.steps = burst
    ids = [eng.add_request(p, params) for p in prompts]
    per_token, seen = [], 0
    try:
        while eng.has_unfinished():
            t = clocks()
            outs = eng.step()
            dt = clocks() - t
            n = next((o.num_tokens for o in outs if o.request_id == ids[0]), seen)
            if n - seen == burst:
                per_token.append(dt / burst)
            seen = n
    finally:
        eng.bursts.steps = 1
    return per_token


def capture_decode(eng: LLMEngine, prompts, params) -> tuple[tuple[int, int], tuple]:
    """Runs ``prompts`` once (compiling every shape they use) and returns the all-decode
    bucket's shape and the packed inputs of one step at it."""
    shape = eng.buckets.shape_for(len(prompts), 0)
    captured = {}
    execute = eng.runner.execute_packed

    def capture(s, ibuf, fbuf, *args, **kwargs):
        if s == shape:
            captured["packed"] = (ibuf, fbuf)
        return execute(s, ibuf, fbuf, *args, **kwargs)

    eng.runner.execute_packed = capture
    try:
        decode_steps(eng, prompts, params)
    finally:
        eng.runner.execute_packed = execute
    return shape, captured["packed"]


def forward_executable(runner, shape: tuple[int, int]) -> jax.stages.Compiled:
    """The step's forward alone (``runner._forward_step``: no sampling), compiled for
    ``shape`` as the runner compiles its steps: the first half of the two-executable step
    the engine ran before the sampling moved into the step."""
    jitted = jax.jit(runner_module._fresh(runner_module._forward_step),
                     static_argnames=("spec",), donate_argnums=(1, 2))
    ishape, fshape, _ = runner.buffer_shapes(shape)
    low = runner.programs.lowering
    spec = dataclasses.replace(low.step_spec(shape, burst_steps=1), mesh=None,
                               capture_layer=None)
    return jitted.lower(*low.args, jax.ShapeDtypeStruct(ishape, jnp.int32),
                        jax.ShapeDtypeStruct(fshape, jnp.float32), spec=spec).compile()


class TwoExecutables:
    """The step as two executable calls, the forward then the sampling executable, with
    the one-executable step's signature and results: installed in the runner for a shape,
    the engine runs the way it did before (``--split-ab``)."""

    def __init__(self, step: "DeviceStep"):
        self.forward, self.sample, self.inputs = step.forward, step.sample, step.inputs

    def __call__(self, params, kv_cache, state, ibuf, fbuf, masks, spare):
        logits, kv_cache, state, prompt = self.forward(params, kv_cache, state, ibuf, fbuf)
        out, state = self.sample(state, self.inputs(logits, ibuf, fbuf))
        return out, spare, kv_cache, state, prompt


class DeviceStep:
    """The captured all-decode step run back to back on its own inputs (KV cache and
    penalty state fed back): as the engine's one executable (forward and sampling), as
    the forward and the sampling executable (two calls), and the forward alone."""

    def __init__(self, eng: LLMEngine, packed, shape):
        self.runner, self.shape = eng.runner, shape
        self.exe, self.layout = self.runner.programs.compiled(shape)
        self.forward = forward_executable(self.runner, shape)
        self.packed = packed
        self.ibuf, self.fbuf = map(jax.device_put, packed)
        self.masks = self.runner.all_allowed(self.layout.mask_shape)  # a decode step's
        programs = self.runner.programs
        self.rows = programs.lowering.rows_for(shape)
        self.sample = programs.sampler(self.rows)
        self.spare = self.runner.spare_logits(self.rows)  # passed along, call to call

    def inputs(self, logits, ibuf=None, fbuf=None) -> SampleInputs:
        """The sampling executable's inputs: the forward's ``logits`` [vocab, S], padded to
        the sampler's rows, and what the packed buffers (default: the captured step's) say
        of the rows, as the runner makes them."""
        arrays = self.layout.host_arrays(*((ibuf, fbuf) if ibuf is not None else self.packed))
        logits = jnp.pad(logits, ((0, 0), (0, self.rows - logits.shape[1])))
        return sample_inputs(arrays, logits, self.rows, self.runner.state_sink)

    def without_bursts(self) -> jax.stages.Compiled:
        """The captured shape's step compiled without the decode-burst loop (as with
        ``decode_burst`` 1), for the same buffers: ``time("one", exe=...)``."""
        return self.runner.programs.lowering.lower(self.shape, burst_steps=1)[0].compile()

    def time(self, mode: str, calls: int = CALLS, exe: jax.stages.Compiled | None = None
             ) -> np.ndarray:
        """(wall, CPU) seconds per call over ``calls`` calls; ``mode``: "one" (the
        engine's step, or ``exe`` in its place: ``without_bursts``), "two" (forward, then
        ``self.sample``) or "forward"."""
        r = self.runner
        t = clocks()
        for _ in range(calls):
            if mode == "one":
                out, self.spare, r.kv_cache, r.state, _ = (exe or self.exe)(
                    r.params, r.kv_cache, r.state, self.ibuf, self.fbuf, self.masks,
                    self.spare)
                continue
            out, r.kv_cache, r.state, _ = self.forward(r.params, r.kv_cache, r.state,
                                                       self.ibuf, self.fbuf)
            if mode == "two":
                out, r.state = self.sample(r.state, self.inputs(out))
        jax.block_until_ready(out)
        return (clocks() - t) / calls


def step_weights(params, experts_per_token: int = 0) -> list[jax.Array]:
    """Every weight matrix a decode step multiplies by (runtime layout, stacked or
    unrolled): the layers' projections ([in, out]), then the LM head ([vocab, hidden]). Of
    an MoE layer's experts, ``experts_per_token`` experts' gate/up and down matrices (what
    one token multiplies by: the active parameters)."""
    layers = params["layers"]
    first = layers if isinstance(layers, dict) else layers[0]
    names = [n for n in MATRICES if n in first and n not in EXPERTS]
    experts = [n for n in ("we_gate_up", "we_down") if n in first]
    if isinstance(layers, dict):
        count = layers[names[0]].shape[0]
        per_layer = [{n: layers[n][i] for n in names + experts} for i in range(count)]
    else:
        per_layer = layers
    ws = []
    for layer in per_layer:
        ws += [layer[n] for n in names]
        if experts:  # the first k experts' columns of we_gate_up, their rows of we_down
            down = layer["we_down"]  # [E, inter, hidden]
            inter, hidden = down.shape[1:]
            ws.append(layer["we_gate_up"][:, :experts_per_token * 2 * inter])
            ws.append(down[:experts_per_token].reshape(experts_per_token * inter, hidden))
    head = params.get("lm_head")
    return ws + [params["embed"] if head is None else head]


class MatmulCeiling:
    """One jitted program doing ``rows`` x W for every W in ``weights`` (``step_weights``:
    the last one the LM head, multiplied in the step's orientation, ``head_product``), one
    after the other as in the step (an optimization barrier ties each input to the
    previous product, so XLA neither runs them side by side nor drops one)."""

    def __init__(self, weights: list[jax.Array], rows: int):
        rng = np.random.default_rng(1)
        ins = [w.shape[0] for w in weights[:-1]] + [weights[-1].shape[1]]
        self.xs = [jnp.asarray(rng.standard_normal((rows, n), np.float32)) for n in ins]
        self.weights = weights
        self.flops = float(sum(2 * rows * w.shape[0] * w.shape[1] for w in weights))

        def chain(xs, ws):
            outs, prev = [], None
            for i, (x, w) in enumerate(zip(xs, ws)):
                if prev is not None:
                    x, _ = jax.lax.optimization_barrier((x, prev))
                prev = (head_product(w, x, vocab_major=True) if i == len(ws) - 1
                        else jnp.dot(x, w, preferred_element_type=jnp.float32))
                outs.append(prev)
            return outs

        self.program = jax.jit(chain)
        jax.block_until_ready(self.program(self.xs, weights))

    def time(self) -> np.ndarray:
        """(wall, CPU) seconds per call over ``CALLS`` calls."""
        t = clocks()
        for _ in range(CALLS):
            out = self.program(self.xs, self.weights)
        jax.block_until_ready(out)
        return (clocks() - t) / CALLS


def argmax_sampler(step: DeviceStep):
    """The sampling executable as it was built with ``jnp.argmax`` (XLA:CPU's variadic
    reduce) instead of ``row_argmax``: the baseline of ``--sampler-ab``."""
    r = step.runner
    logits, r.kv_cache, r.state, _ = step.forward(r.params, r.kv_cache, r.state, step.ibuf,
                                                  step.fbuf)
    inputs = step.inputs(logits)
    kept = sampler_module.row_argmax
    sampler_module.row_argmax = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    try:
        return jax.jit(runner_module._fresh(runner_module._sample), donate_argnums=(0,)).lower(
            r.state, inputs).compile()
    finally:
        sampler_module.row_argmax = kept

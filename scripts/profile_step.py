"""A decode step against the f32 matmul ceiling of this machine, per batch size.

    python scripts/profile_step.py [--batches 1,8,32 | --batch B] [--prompt-len 128] [--reps 5]
                                   [--overlap] [--split-ab] [--host-phases]

For each batch size B: ``B`` greedy requests on the bench model of ``bench_engine.py`` (4
layers, hidden 512, GQA 8/2, vocab 8192, f32) through one engine, ``--reps`` times; the
median all-decode engine step (async scheduling, the default) is the *engine step*. The
inputs of one all-decode step are captured and the engine's compiled step (forward and
sampling in one executable) runs back to back on them (30 calls per repetition, KV cache fed
back): the *device-only step*; so do the forward alone and the forward followed by the
sampling executable (two calls, as the engine ran before). ``--split-ab`` also runs the
engine with those two calls in place of its step, alternated with it in every repetition.

The ceiling is measured in the same run, on the same threads, right after the steps: one
jitted program doing every matmul of the step (each layer's q, k, v, o, gate-up and down
projections and the LM head, on the engine's own weight arrays) at B rows. Its FLOP rate is
the ceiling; a step's share is its FLOPs (those matmuls plus attention at the mean context)
per second over that rate. Measuring both sides in one run makes machine load hit both
(this machine is shared; ``uptime`` is printed at start and end). Every time is also taken
as this process's CPU time, which the neighbours move much less. ``--overlap`` also runs
synchronous scheduling and reports how long the device waits for the host at each dispatch;
``--sampler-ab`` also times the device-only step with the sampler built on ``jnp.argmax``
(before ``row_argmax``), alternated with the current one. ``--host-phases`` splits the
engine thread's own CPU time (``time.thread_time``) of each all-decode step by phase
(``HostPhases``): XLA's worker threads fill both cores, so this CPU adds onto the step.
"""
from __future__ import annotations

import argparse
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jserve import SamplingParams
from jserve.config import LlamaConfig
from jserve.engine import runner as runner_module
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.kernels import resolve_impl
from jserve.model.weights import init_params
from jserve.sampling import sampler as sampler_module

BENCH_MODEL = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=64, max_position_embeddings=4096, eos_token_ids=(2,))
CALLS = 30  # device-only step and ceiling calls per repetition


def clocks() -> np.ndarray:
    """(wall, this process's CPU time over all its threads) in seconds. CPU time moves far
    less with the neighbours' load than wall time does, so both are reported."""
    return np.array([time.perf_counter(), time.process_time()])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class DispatchProbe:
    """Watches the device through the engine's own calls. At each step's dispatch: is the
    previous step still running (then the device goes on to this one without waiting for
    the host: no idle gap), and if not, how long since the host saw the previous step's
    tokens (synchronous: the host waits for them, so that is the idle gap; async: a lower
    bound of it)."""

    def __init__(self, eng: LLMEngine):
        self.records: list[tuple[bool, float]] = []  # (device busy at dispatch, gap seconds)
        self._last, self._ready_at = None, None
        self._execute, self._read = eng.runner.execute_packed, eng._read
        eng.runner.execute_packed, eng._read = self.execute, self.read

    def execute(self, *args, **kwargs):
        now = time.perf_counter()
        if self._last is not None and self._ready_at is not None:
            busy = not self._last.tokens.is_ready()
            self.records.append((busy, 0.0 if busy else now - self._ready_at))
        self._last = out = self._execute(*args, **kwargs)
        return out

    def read(self, done):
        jax.block_until_ready(done.out.tokens)
        self._ready_at = time.perf_counter()
        return self._read(done)

    def take(self) -> list[tuple[bool, float]]:
        records, self.records, self._last, self._ready_at = self.records, [], None, None
        return records


def bench_engine(batch: int, attention_impl: str = "auto") -> LLMEngine:
    """The bench model's engine sized for ``batch`` decodes (buckets compile on first use)."""
    cfg = BENCH_MODEL
    return LLMEngine(cfg, init_params(cfg), None,
                     EngineConfig(max_num_seqs=batch, max_num_batched_tokens=512,
                                  max_model_len=2048, warmup=False,
                                  attention_impl=attention_impl))


def bench_prompts(batch: int, prompt_len: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, BENCH_MODEL.vocab_size, prompt_len).tolist() for _ in range(batch)]


class HostPhases:
    """The engine thread's CPU time per step, split by phase: each phase is a method of the
    engine or one of its parts, wrapped so that time goes to the innermost phase running
    (exclusive times; ``other`` is the step's time outside every phase). Only the steps
    ``decode_steps`` keeps are recorded."""

    PHASES = (  # (label, owner attribute path, method)
        ("schedule", "scheduler", "schedule"),
        ("launch (rows, flags)", "", "_launch"),
        ("build", "builder", "build"),
        ("pack", "_slots", "buffers"),
        ("step executable call", "runner", "execute_packed"),
        ("sampler call", "runner", "sample"),
        ("sampled_on_device", "scheduler", "sampled_on_device"),
        ("token read", "", "_read"),
        ("complete: update", "scheduler", "update"),
        ("complete: outputs", "", "_complete"),
    )

    def __init__(self, eng: LLMEngine):
        self.runs: list[list[dict[str, float]]] = []  # per ``decode_steps`` run, per step
        self._stack: list[str] = []
        self._mark = 0.0
        self._now: dict[str, float] | None = None
        for label, path, method in self.PHASES:
            owner = eng
            for name in filter(None, path.split(".")):
                owner = getattr(owner, name)
            setattr(owner, method, self._wrap(label, getattr(owner, method)))

    def _charge(self) -> None:
        now = time.thread_time()
        if self._now is not None:
            top = self._stack[-1] if self._stack else "other"
            self._now[top] = self._now.get(top, 0.0) + now - self._mark
        self._mark = now

    def _wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            self._charge()
            self._stack.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self._charge()
                self._stack.pop()
        return timed

    def start(self) -> None:
        self._now = {}
        self._mark = time.thread_time()

    def stop(self, keep: bool) -> None:
        self._charge()
        if keep:
            self.runs[-1].append(self._now)
        self._now = None

    def report(self) -> None:
        """Median per step of each phase over the kept steps (each run's ramp and tail
        dropped, as ``decode_steps`` drops them)."""
        steps = [s for run in self.runs for s in run[2:-2]]
        labels = [label for label, _, _ in self.PHASES] + ["other"]
        med = {k: 1e3 * float(np.median([s.get(k, 0.0) for s in steps])) for k in labels}
        total = 1e3 * float(np.median([sum(s.values()) for s in steps]))
        print(f"  engine thread CPU per all-decode step (median of {len(steps)} steps): "
              f"{total:.3f} ms")
        for k in labels:
            print(f"    {k:24s} {med[k]:6.3f} ms")


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
                     static_argnames=("layout", "cfg", "attention_impl", "mesh", "rows",
                                      "capture_layer"), donate_argnums=(1, 2))
    ishape, fshape = runner.buffer_shapes(shape)
    return jitted.lower(*runner._specs(), jax.ShapeDtypeStruct(ishape, jnp.int32),
                        jax.ShapeDtypeStruct(fshape, jnp.float32),
                        layout=runner.compiled(shape)[1], cfg=runner.cfg,
                        attention_impl=runner.attention_impl, mesh=None,
                        rows=runner.rows_for(shape), capture_layer=None).compile()


class TwoExecutables:
    """The step as two executable calls, the forward then the sampling executable, with
    the one-executable step's signature and results: installed in the runner for a shape,
    the engine runs the way it did before (``--split-ab``)."""

    def __init__(self, forward, sample):
        self.forward, self.sample = forward, sample

    def __call__(self, params, kv_cache, state, ibuf, fbuf):
        inputs, kv_cache, state = self.forward(params, kv_cache, state, ibuf, fbuf)
        out, state = self.sample(state, inputs)
        return out, inputs, kv_cache, state


class DeviceStep:
    """The captured all-decode step run back to back on its own inputs (KV cache and
    penalty state fed back): as the engine's one executable (forward and sampling), as
    the forward and the sampling executable (two calls), and the forward alone."""

    def __init__(self, eng: LLMEngine, packed, shape):
        self.runner = eng.runner
        self.exe, _ = self.runner.compiled(shape)
        self.forward = forward_executable(self.runner, shape)
        self.ibuf, self.fbuf = map(jax.device_put, packed)
        self.sample = self.runner.sampler(self.runner.rows_for(shape))

    def time(self, mode: str, calls: int = CALLS) -> np.ndarray:
        """(wall, CPU) seconds per call over ``calls`` calls; ``mode``: "one" (the
        engine's step), "two" (forward, then ``self.sample``) or "forward"."""
        r = self.runner
        t = clocks()
        for _ in range(calls):
            if mode == "one":
                out, _, r.kv_cache, r.state = self.exe(r.params, r.kv_cache, r.state,
                                                       self.ibuf, self.fbuf)
                continue
            inputs, r.kv_cache, r.state = self.forward(r.params, r.kv_cache, r.state,
                                                       self.ibuf, self.fbuf)
            out = inputs.logits
            if mode == "two":
                out, r.state = self.sample(r.state, inputs)
        jax.block_until_ready(out)
        return (clocks() - t) / calls


def step_weights(params) -> list[jax.Array]:
    """Every weight matrix a decode step multiplies by (runtime layout, stacked or
    unrolled): the layers' projections, then the LM head."""
    layers = params["layers"]
    names = ("wq", "wk", "wv", "wo", "w_gate_up", "w_down")
    if isinstance(layers, dict):
        ws = [layers[n][i] for i in range(layers["wq"].shape[0]) for n in names]
    else:
        ws = [layer[n] for layer in layers for n in names]
    head = params.get("lm_head")
    return ws + [params["embed"].T if head is None else head]


class MatmulCeiling:
    """One jitted program doing ``rows`` x W for every W in ``weights``, one after the other
    as in the step (an optimization barrier ties each input to the previous product, so
    XLA neither runs them side by side nor drops one)."""

    def __init__(self, weights: list[jax.Array], rows: int):
        rng = np.random.default_rng(1)
        self.xs = [jnp.asarray(rng.standard_normal((rows, w.shape[0]), np.float32))
                   for w in weights]
        self.weights = weights
        self.flops = float(sum(2 * rows * w.shape[0] * w.shape[1] for w in weights))

        def chain(xs, ws):
            outs, prev = [], None
            for x, w in zip(xs, ws):
                if prev is not None:
                    x, _ = jax.lax.optimization_barrier((x, prev))
                prev = jnp.dot(x, w, preferred_element_type=jnp.float32)
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
    inputs, r.kv_cache, r.state = step.forward(r.params, r.kv_cache, r.state, step.ibuf,
                                               step.fbuf)
    kept = sampler_module.row_argmax
    sampler_module.row_argmax = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    try:
        return jax.jit(runner_module._fresh(runner_module._sample), donate_argnums=(0,)).lower(
            r.state, inputs).compile()
    finally:
        sampler_module.row_argmax = kept


def attention_flops(cfg: LlamaConfig, rows: int, context: int) -> float:
    """QK and PV of ``rows`` decodes at ``context`` keys, every layer."""
    return 4.0 * rows * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context


ONE, TWO, SYNC = "engine step (async)", "engine, two executables", "engine step (sync)"
BURST = "engine, per token in bursts"


def profile_batch(batch: int, a, bar: tqdm) -> dict:
    eng = bench_engine(batch, a.attention_impl)
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    prompts = bench_prompts(batch, a.prompt_len)
    shape, packed = capture_decode(eng, prompts, params)
    step = DeviceStep(eng, packed, shape)
    fused = eng.runner._compiled[shape]
    two = (TwoExecutables(step.forward, step.sample), fused[1])
    # Engine variants, alternated within each repetition: (label, async, step program).
    variants = [(ONE, True, fused)]
    if a.split_ab:
        variants.append((TWO, True, two))
    if a.overlap:
        variants.append((SYNC, False, fused))
    steps: dict[str, list[np.ndarray]] = {v[0]: [] for v in variants}
    gaps: dict[bool, list[tuple[bool, float]]] = {True: [], False: []}
    probe = DispatchProbe(eng) if a.overlap else None
    if a.decode_burst > 1:
        steps[BURST] = []
        burst_token_times(eng, prompts, params, a.decode_burst)  # compiles the burst
        eng.runner.wait_compiles()
    for _ in range(a.reps):
        for label, mode, program in variants:
            eng.async_scheduling = mode
            eng.runner._compiled[shape] = program
            steps[label].append(np.median(decode_steps(eng, prompts, params), axis=0))
            if probe is not None:
                gaps[mode] += probe.take()[2:-2]
        if a.decode_burst > 1:
            eng.async_scheduling = True
            steps[BURST].append(np.median(
                burst_token_times(eng, prompts, params, a.decode_burst), axis=0))
        bar.update()
    eng.runner._compiled[shape] = fused
    if probe is not None:
        eng.runner.execute_packed, eng._read = probe._execute, probe._read
    phases = None
    if a.host_phases:  # runs of their own: the wrappers cost a little CPU each call
        eng.async_scheduling = True
        phases = HostPhases(eng)
        for _ in range(a.reps):
            decode_steps(eng, prompts, params, phases)
    # Device step and ceiling alternate, so a change of machine load hits both alike.
    ceiling = MatmulCeiling(step_weights(eng.runner.params), batch)
    times: dict[str, list[np.ndarray]] = {"one": [], "two": [], "forward": [], "ceiling": []}
    samplers = {"two": step.sample}
    if a.sampler_ab:
        samplers["two, jnp.argmax sampler"] = argmax_sampler(step)
        times["two, jnp.argmax sampler"] = []
    for _ in range(a.reps):
        times["one"].append(step.time("one"))
        times["forward"].append(step.time("forward"))
        for name, sample in samplers.items():
            step.sample = sample
            times[name].append(step.time("two"))
        step.sample = samplers["two"]
        times["ceiling"].append(ceiling.time())
    bar.update()
    t = {k: np.median(v, axis=0) for k, v in times.items()}
    flops = ceiling.flops + attention_flops(BENCH_MODEL, batch, a.prompt_len + a.new_tokens // 2)
    return dict(batch=batch, device=t, steps=steps, gaps=gaps, flops=flops,
                ceiling=ceiling.flops / t["ceiling"], ceiling_time=t["ceiling"], phases=phases)


def report(r: dict, overlap: bool) -> None:
    """Each step as wall ms and share of the wall-clock ceiling, then CPU ms and share of
    the CPU-time ceiling (same FLOPs over this process's CPU seconds)."""
    ceiling, flops = r["ceiling"], r["flops"]  # ceiling: (wall, CPU) FLOP/s

    def row(name: str, t: np.ndarray) -> str:
        shares = 100 * flops / t / ceiling
        return (f"  {name:26s} {1e3 * t[0]:7.2f} ms {shares[0]:5.1f}%   "
                f"CPU {1e3 * t[1]:7.2f} ms {shares[1]:5.1f}%")

    print(f"batch {r['batch']:3d}: step {flops / 1e9:.3f} GFLOP; ceiling "
          f"{ceiling[0] / 1e9:.1f} GFLOP/s wall, {ceiling[1] / 1e9:.1f} per CPU second (its "
          f"matmuls alone {1e3 * r['ceiling_time'][0]:.2f} ms, CPU "
          f"{1e3 * r['ceiling_time'][1]:.2f} ms)")
    engine = {k: np.median(v, axis=0) for k, v in r["steps"].items()}
    for label in (ONE, TWO, BURST):
        if label in engine:
            print(row(label, engine[label]) + "  (wall per repetition: "
                  + ", ".join(f"{1e3 * t[0]:.2f}" for t in r["steps"][label]) + ")")
    if TWO in engine:
        print(f"  one / two executables, engine step: wall {engine[ONE][0] / engine[TWO][0]:.3f}"
              f", CPU {engine[ONE][1] / engine[TWO][1]:.3f}")
    d = r["device"]
    print(row("device-only step", d["one"]) + "  (the engine's one executable)")
    print(row("device-only, two calls", d["two"]) + "  (forward, then the sampling executable)")
    print(row("forward executable alone", d["forward"]))
    if "two, jnp.argmax sampler" in d:
        print(row("two calls, jnp.argmax", d["two, jnp.argmax sampler"]) + "  (the sampler "
              "before row_argmax, alternated with the two-call step)")
    if r["phases"] is not None:
        r["phases"].report()
    if not overlap:
        return
    print(row(SYNC, engine[SYNC]) + f"  async / sync (wall) {engine[ONE][0] / engine[SYNC][0]:.3f}")
    for mode in (False, True):
        busy = [b for b, _ in r["gaps"][mode]]
        gap = [g for _, g in r["gaps"][mode]]
        print(f"  {'async' if mode else 'sync '}: {100 * np.mean(busy):5.1f}% of {len(busy)} "
              f"steps dispatched while the previous one still ran; idle gap at dispatch "
              f"median {1e3 * np.median(gap):.2f} ms, mean {1e3 * np.mean(gap):.2f} ms"
              + (" (a lower bound)" if mode else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--batch", type=int, default=None, help="one batch size (overrides --batches)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=40, help="greedy tokens per request")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (medians are taken)")
    ap.add_argument("--sampler-ab", action="store_true",
                    help="also time the two-call device-only step with the sampler built on "
                         "jnp.argmax")
    ap.add_argument("--split-ab", action="store_true",
                    help="also run the engine with the step as two executables (forward, then "
                         "sampling: before this pass), alternated with the one-executable step")
    ap.add_argument("--host-phases", action="store_true",
                    help="also split the engine thread's CPU time per all-decode step by "
                         "phase (extra runs, async scheduling)")
    ap.add_argument("--attention-impl", default="auto",
                    help="the engine's attention_impl (auto on CPU: the native decode kernel "
                         "where it builds; reference: the jnp reference)")
    ap.add_argument("--decode-burst", type=int, default=1,
                    help="also run the engine with decode bursts of this many steps "
                         "(EngineConfig.decode_burst) and report its time per token inside "
                         "bursts, alternated with the plain engine step")
    ap.add_argument("--overlap", action="store_true",
                    help="also run synchronous scheduling and probe the dispatch gaps")
    a = ap.parse_args()
    batches = [a.batch] if a.batch else [int(b) for b in a.batches.split(",")]
    print(f"load at start: {uptime()}")
    print(f"jax {jax.__version__} on {jax.default_backend()}; attention_impl {a.attention_impl}"
          f" ({resolve_impl(a.attention_impl)})")
    results = []
    with tqdm(total=len(batches) * (a.reps + 1), desc="profile", unit="run") as bar:
        for batch in batches:
            results.append(profile_batch(batch, a, bar))
    for r in results:
        report(r, a.overlap)
    print(f"load at end: {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A decode step against the f32 matmul ceiling of this machine, per batch size
(``scripts/profile_step.py``): the engine's all-decode step (async, and optionally sync, as
two executables, or in decode bursts), the device-only step on captured inputs, and the
ceiling, all measured in one run; ``report`` prints each as wall and CPU time and share of
the ceiling."""
from __future__ import annotations

import numpy as np
from tqdm import tqdm

from harness.decode_step import (
    DeviceStep,
    MatmulCeiling,
    TwoExecutables,
    argmax_sampler,
    bench_engine,
    bench_prompts,
    burst_token_times,
    capture_decode,
    decode_steps,
    step_weights,
)
from harness.flops import attention_flops
from harness.host_probes import DispatchProbe, HostPhases
from jserve import SamplingParams

ONE, TWO, SYNC = "engine step (async)", "engine, two executables", "engine step (sync)"
BURST = "engine, per token in bursts"


def profile_batch(batch: int, a, bar: tqdm, model=None) -> dict:
    """``model``: (ModelConfig, params) of ``bench_model`` (None: the bench model)."""
    eng = bench_engine(batch, a.attention_impl, model,
                       a.decode_burst if a.decode_burst > 1 else "auto")
    cfg = eng.runner.model_config
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p,
                            max_tokens=a.new_tokens, ignore_eos=True)
    prompts = bench_prompts(batch, a.prompt_len, cfg.vocab_size)
    shape, packed = capture_decode(eng, prompts, params)
    step = DeviceStep(eng, packed, shape)
    fused = eng.runner.programs.steps[shape]
    two = (TwoExecutables(step), fused[1])
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
        burst_token_times(eng, prompts, params, a.decode_burst)  # warms the burst path up
        eng.runner.programs.wait_compiles()
    for _ in range(a.reps):
        for label, mode, program in variants:
            eng.async_scheduling = mode
            eng.runner.programs.steps[shape] = program
            steps[label].append(np.median(decode_steps(eng, prompts, params), axis=0))
            if probe is not None:
                gaps[mode] += probe.take()[2:-2]
        if a.decode_burst > 1:
            eng.async_scheduling = True
            steps[BURST].append(np.median(
                burst_token_times(eng, prompts, params, a.decode_burst), axis=0))
        bar.update()
    eng.runner.programs.steps[shape] = fused
    if probe is not None:
        eng.runner.execute_packed, eng._read = probe._execute, probe._read
    phases = burst_phases = None
    if a.host_phases:  # runs of their own: the wrappers cost a little CPU each call
        eng.async_scheduling = True
        phases = HostPhases(eng)
        for _ in range(a.reps):
            decode_steps(eng, prompts, params, phases)
        if a.decode_burst > 1:  # the same, each engine step a burst of that many tokens
            burst_phases, phases.runs = phases.runs, []
            eng.bursts.steps = a.decode_burst
            for _ in range(a.reps):
                decode_steps(eng, prompts, params, phases)
            eng.bursts.steps = 1
            burst_phases, phases.runs = phases.runs, burst_phases
    # Device step and ceiling alternate, so a change of machine load hits both alike.
    ceiling = MatmulCeiling(step_weights(eng.runner.params,
                                         eng.runner.model_config.num_experts_per_tok), batch)
    times: dict[str, list[np.ndarray]] = {"one": [], "two": [], "forward": [], "ceiling": []}
    plain = step.without_bursts() if a.loop_ab else None
    if plain is not None:
        times["no burst loop"] = []
    samplers = {"two": step.sample}
    if a.sampler_ab:
        samplers["two, jnp.argmax sampler"] = argmax_sampler(step)
        times["two, jnp.argmax sampler"] = []
    for _ in range(a.reps):
        times["one"].append(step.time("one"))
        if plain is not None:
            times["no burst loop"].append(step.time("one", exe=plain))
        times["forward"].append(step.time("forward"))
        for name, sample in samplers.items():
            step.sample = sample
            times[name].append(step.time("two"))
        step.sample = samplers["two"]
        times["ceiling"].append(ceiling.time())
    bar.update()
    t = {k: np.median(v, axis=0) for k, v in times.items()}
    flops = ceiling.flops + attention_flops(cfg, batch, a.prompt_len + a.new_tokens // 2)
    return dict(batch=batch, device=t, steps=steps, gaps=gaps, flops=flops,
                ceiling=ceiling.flops / t["ceiling"], ceiling_time=t["ceiling"], phases=phases,
                burst_phases=burst_phases, burst=a.decode_burst)


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
    if "no burst loop" in d:
        loop = d["one"][0] / d["no burst loop"][0]
        print(row("device-only, no burst loop", d["no burst loop"]) + "  (compiled with "
              f"decode_burst 1, alternated; loop / no loop {loop:.3f})")
    print(row("device-only, two calls", d["two"]) + "  (forward, then the sampling executable)")
    print(row("forward executable alone", d["forward"]))
    if "two, jnp.argmax sampler" in d:
        print(row("two calls, jnp.argmax", d["two, jnp.argmax sampler"]) + "  (the sampler "
              "before row_argmax, alternated with the two-call step)")
    if r["phases"] is not None:
        r["phases"].report()
        if r["burst_phases"] is not None:
            runs, r["phases"].runs = r["phases"].runs, r["burst_phases"]
            r["phases"].report(per=r["burst"])
            r["phases"].runs = runs
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

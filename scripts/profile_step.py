"""Where a decode step's time goes, and how much of it the device sits idle waiting for the
host, with async scheduling (overlap) on and off.

    python scripts/profile_step.py [--batch 32] [--prompt-len 128] [--reps 3]

Runs ``batch`` greedy requests on the bench model of ``bench_engine.py`` (4 layers, hidden
512, GQA 8/2, vocab 8192, f32) through one engine, alternating synchronous and async
scheduling ``--reps`` times each, and takes the median all-decode engine step of each mode.
It captures the inputs of one all-decode step and times the compiled step plus the sampling
executable back to back (30 calls per repetition, KV cache fed back): the device-only step.
Two views of the device's idle time: engine step - device-only step (per step, in ms and as
% of the device-only step), and at every dispatch whether the previous step was still
running (``DispatchProbe``: then the device waits for nothing) and otherwise how long ago the
host had its tokens. The issue's goal: idle gap under 5% of the step at batch 32 with
overlap. Also prints achieved GFLOP/s against the 110 GFLOP/s f32
ceiling used in docs/bench.md. On a CPU host the device and the host share the cores, so
overlap gains less there than on an accelerator.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jserve import SamplingParams
from jserve.config import LlamaConfig
from jserve.engine.config import EngineConfig
from jserve.engine.engine import LLMEngine
from jserve.model.weights import init_params

CEILING_GFLOPS = 110.0


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


def decode_steps(eng: LLMEngine, prompts, params) -> list[float]:
    """Wall time of every engine step taken while every running request decodes."""
    for p in prompts:
        eng.add_request(p, params)
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        decoding = bool(eng.scheduler.running) and not eng.scheduler.waiting and all(
            r.is_decode for r in eng.scheduler.running)
        eng.step()
        if decoding:
            steps.append(time.perf_counter() - t)
    return steps[2:-2]  # drop the ramp and the tail (the last token's read step)


def device_step(eng: LLMEngine, packed, shape, reps: int) -> tuple[float, float]:
    """(step executable alone, step + sampler) seconds per call, back to back."""
    runner = eng.runner
    exe, _ = runner.compiled(shape)
    ibuf, fbuf = map(jax.device_put, packed)
    sampler = runner.sampler()
    device, forward_only = [], []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(30):
            inputs, runner.kv_cache, runner.state = exe(runner.params, runner.kv_cache,
                                                        runner.state, ibuf, fbuf)
        jax.block_until_ready(inputs.logits)
        forward_only.append((time.perf_counter() - t) / 30)
        t = time.perf_counter()
        for _ in range(30):
            inputs, runner.kv_cache, runner.state = exe(runner.params, runner.kv_cache,
                                                        runner.state, ibuf, fbuf)
            out, runner.state = sampler(runner.state, inputs)
        jax.block_until_ready(out.tokens)
        device.append((time.perf_counter() - t) / 30)
    return float(np.median(forward_only)), float(np.median(device))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096, eos_token_ids=(2,))
    eng = LLMEngine(cfg, init_params(cfg), None,
                    EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=512,
                                 max_model_len=2048, warmup=False))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    prompts = [rng.integers(3, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.batch)]
    decode_shape = eng.buckets.shape_for(a.batch, 0)
    captured = {}
    execute = eng.runner.execute_packed

    def capture(shape, ibuf, fbuf, *args):
        if shape == decode_shape:
            captured["packed"] = (ibuf, fbuf)
        return execute(shape, ibuf, fbuf, *args)

    eng.runner.execute_packed = capture
    decode_steps(eng, prompts, params)  # compiles every shape the runs use
    steps: dict[bool, list[float]] = {False: [], True: []}
    gaps: dict[bool, list[tuple[bool, float]]] = {False: [], True: []}
    probe = DispatchProbe(eng)
    for _ in range(a.reps):
        for mode in (False, True):
            eng.async_scheduling = mode
            steps[mode].append(float(np.median(decode_steps(eng, prompts, params))))
            gaps[mode] += probe.take()[2:-2]
    eng.runner.execute_packed, eng._read = probe._execute, probe._read
    forward_only, device = device_step(eng, captured["packed"], decode_shape, a.reps)

    print(f"batch {a.batch}: step executable alone {1e3 * forward_only:7.2f} ms; "
          f"with the sampling executable {1e3 * device:7.2f} ms (device-only step)")
    ctx = a.prompt_len + a.new_tokens // 2
    flops = a.batch * 2 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size)
    flops += a.batch * cfg.num_hidden_layers * 4 * cfg.num_attention_heads * cfg.head_dim * ctx
    print(f"{'':24s} {'step':>9s} {'idle gap':>9s} {'gap/step':>9s} {'GFLOP/s':>8s}")
    rows = [("device-only step", device)] + [
        (f"engine, {'async' if mode else 'sync'} x{a.reps}", float(np.median(steps[mode])))
        for mode in (False, True)]
    for name, t in rows:
        gap = t - device
        print(f"{name:24s} {t * 1e3:7.2f}ms {gap * 1e3:7.2f}ms {100 * gap / device:8.1f}% "
              f"{flops / t / 1e9:8.1f}")
    for mode in (False, True):
        busy = [b for b, _ in gaps[mode]]
        gap = [g for _, g in gaps[mode]]
        print(f"{'async' if mode else 'sync'}: {100 * np.mean(busy):5.1f}% of {len(busy)} steps "
              f"dispatched while the previous one still ran; idle gap at dispatch median "
              f"{1e3 * np.median(gap):.2f} ms, mean {1e3 * np.mean(gap):.2f} ms "
              f"({100 * np.mean(gap) / device:.1f}% of the device-only step)"
              + (" (a lower bound)" if mode else ""))
    print("per-repetition engine steps (ms): "
          + "; ".join(f"{'async' if m else 'sync'} "
                      + ", ".join(f"{1e3 * t:.2f}" for t in steps[m]) for m in (False, True)))
    print(f"async / sync engine step: "
          f"{np.median(steps[True]) / np.median(steps[False]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

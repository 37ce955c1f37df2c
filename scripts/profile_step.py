"""Where a decode step's time goes: device-only time of the compiled step vs the engine step.

    python scripts/profile_step.py [--batch 32] [--prompt-len 128] [--reps 3]

Runs ``batch`` greedy requests on the bench model of ``bench_engine.py`` (4 layers, hidden
512, GQA 8/2, vocab 8192, f32), captures the inputs of one all-decode step, then times the
compiled step alone (30 calls per repetition, KV cache fed back) against the median engine
step (plan + host arrays + device + output processing). Prints both, the host share, and the
achieved GFLOP/s against the 110 GFLOP/s f32 ceiling used in docs/bench.md.
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
    for _ in range(a.batch):
        eng.add_request(rng.integers(3, cfg.vocab_size, a.prompt_len).tolist(), params)
    decode_shape = eng.buckets.shape_for(a.batch, 0)
    captured = {}
    execute = eng.runner.execute

    def capture(shape, arrays):
        if shape == decode_shape:
            captured["arrays"] = arrays
        return execute(shape, arrays)

    eng.runner.execute = capture
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter()
        decoding = all(r.is_decode for r in eng.scheduler.running)
        eng.step()
        if decoding:
            steps.append(time.perf_counter() - t)
    engine_step = float(np.median(steps[2:]))

    runner = eng.runner
    exe, layout = runner.compiled(decode_shape)
    ibuf, fbuf = map(jax.device_put, layout.pack(captured["arrays"]))
    sampler = runner.sampler()
    device, forward_only = [], []
    for _ in range(a.reps):
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
            out = sampler(runner.state, inputs)
        jax.block_until_ready(out.tokens)
        device.append((time.perf_counter() - t) / 30)
    device_step = float(np.median(device))
    print(f"step executable alone {1e3 * float(np.median(forward_only)):7.2f} ms; "
          f"with the sampling executable {1e3 * device_step:7.2f} ms")
    ctx = a.prompt_len + a.new_tokens // 2
    flops = a.batch * 2 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size)
    flops += a.batch * cfg.num_hidden_layers * 4 * cfg.num_attention_heads * cfg.head_dim * ctx
    for name, t in (("device-only step", device_step), ("engine step", engine_step)):
        gf = flops / t / 1e9
        print(f"{name:18s} {t * 1e3:7.2f} ms  {gf:6.1f} GFLOP/s  "
              f"{100 * gf / CEILING_GFLOPS:5.1f}% of {CEILING_GFLOPS:.0f}")
    print(f"host share of the engine step: {100 * (1 - device_step / engine_step):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

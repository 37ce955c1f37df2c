"""Quantized KV cache and weights side by side on the live CPU engine, in one run.

    python scripts/bench_quantization.py [--reps 3] [--new-tokens 32] [--out FILE.json]

Per mode (full precision, KV int8 / fp8_e4m3 / fp8_e5m2, weights int8 / fp8, weights int8 +
KV int8):

1. KV bytes per token: the benchmark model's (the built-in default model, float32) and
   Llama-3.1-8B's in bf16 (``kv_bytes_per_page`` / page size, K and V over all layers).
2. The longest context that fits a fixed budget: the tokens the engine's pool holds with
   ``--kv-budget`` bytes (default model), and what 16 GB of KV holds for Llama-3.1-8B.
3. Decode tok/s at batch 1, 8 and 32 (prompts of 64 tokens, ``--new-tokens`` greedy tokens):
   tokens after the last first token over the time to the last token, median of ``--reps``
   after an untimed run that compiles, and the ratio to full precision. Every mode's engine
   is built first and the repetitions rotate over the modes, so a change in the machine's
   load during the run falls on every mode alike.
4. The tiny-tasks model's exact-answer rate on every held-out task (docs/tiny_tasks.md).

Prints a table, the command and the machine load (``os.getloadavg``) at start and end, and
writes JSON with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jserve import LLM, SamplingParams  # noqa: E402
from jserve.cache.pool import kv_bytes_per_page  # noqa: E402
from jserve.config import ModelConfig  # noqa: E402
from jserve.train.evaluate import evaluate  # noqa: E402
from jserve.train.length_task import count_down, is_held_out, list_fruits  # noqa: E402

MODES = {
    "full precision": dict(),
    "KV int8": dict(kv_cache_dtype="int8"),
    "KV fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
    "KV fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
    "W int8": dict(quantization="int8"),
    "W fp8": dict(quantization="fp8"),
    "W int8 + KV int8": dict(quantization="int8", kv_cache_dtype="int8"),
}
LLAMA_31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, dtype="bfloat16")
PAGE = 16


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def decode_rate(outs) -> float:
    first_all = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs)
    later = sum(t > first_all for o in outs for t in o.metrics.token_times)
    return later / (end - first_all)


def held_out_tasks():
    return [make(n) for make, top in ((count_down, 148), (list_fruits, 48))
            for n in range(1, top + 1) if is_held_out(n)]


def sizes(kw: dict, a) -> dict:
    kv = kw.get("kv_cache_dtype", "auto")
    from jserve.model.weights import DEFAULT_CONFIG
    out = {"kv_bytes_per_token": kv_bytes_per_page(DEFAULT_CONFIG, PAGE, kv_cache_dtype=kv)
           // PAGE,
           "kv_bytes_per_token_llama8b": kv_bytes_per_page(LLAMA_31_8B, PAGE,
                                                           kv_cache_dtype=kv) // PAGE}
    out["llama8b_tokens_in_16GB"] = 16 * 10 ** 9 // out["kv_bytes_per_token_llama8b"]
    return out


def decode_timings(modes: dict, a) -> dict:
    """Decode tok/s per mode and batch, the repetitions rotating over the modes."""
    llms = {name: LLM("default", max_num_seqs=32, max_num_batched_tokens=256,
                      max_model_len=4096, kv_cache_bytes=a.kv_budget, warmup=False, **kw)
            for name, kw in modes.items()}
    out = {name: {"tokens_in_budget": llm.engine.allocator.total * PAGE}
           for name, llm in llms.items()}
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    for batch in tqdm((1, 8, 32), desc="decode batch sizes"):
        prompts = [rng.integers(3, 300, 64).tolist() for _ in range(batch)]
        rates: dict = {name: [] for name in llms}
        for rep in range(a.reps + 1):  # rep 0 compiles
            for name, llm in llms.items():
                outs = llm.generate(prompts, params)
                if rep:
                    rates[name].append(decode_rate(outs))
        for name in llms:
            out[name][f"decode_tok_s_b{batch}"] = statistics.median(rates[name])
            out[name][f"decode_tok_s_b{batch}_reps"] = rates[name]
    return out


def tiny_tasks(kw: dict) -> dict:
    tiny = LLM("tiny-tasks", max_num_seqs=32, max_num_batched_tokens=256, max_model_len=1024,
               warmup=False, **kw)
    score = evaluate(tiny, held_out_tasks(), max_tokens=500)
    return {"tiny_tasks_exact": score.exact, "tiny_tasks_n": score.n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="timed runs per batch size")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--kv-budget", type=int, default=8 << 20,
                   help="KV cache bytes of the default-model engine (longest context)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    p.add_argument("--skip-tiny-tasks", action="store_true",
                   help="timings and sizes only (the evaluation is most of the run)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args()
    results = {"command": " ".join(sys.argv), "load_start": load(), "modes": {}}
    t0 = time.time()
    modes = {name: MODES[name] for name in a.modes.split(",")}
    timings = decode_timings(modes, a)
    for name, kw in tqdm(modes.items(), desc="tiny-tasks per mode"):
        results["modes"][name] = {**sizes(kw, a), **timings[name],
                                  **({} if a.skip_tiny_tasks else tiny_tasks(kw))}
    results["load_end"] = load()
    results["seconds"] = time.time() - t0
    base = results["modes"].get("full precision")
    print(f"command: {results['command']}\nload average at start {results['load_start']}, "
          f"end {results['load_end']} (2-core machine shared with other jobs)")
    print(f"{'mode':<18}{'KV B/tok':>9}{'8B KV B/tok':>12}{'ctx in budget':>14}"
          f"{'8B ctx/16GB':>12}{'b1 tok/s':>14}{'b8 tok/s':>14}{'b32 tok/s':>14}{'tiny exact':>11}")
    for name, r in results["modes"].items():
        rate = lambda b, r=r: (f"{r[f'decode_tok_s_b{b}']:.0f}" + (
            f" ({r[f'decode_tok_s_b{b}'] / base[f'decode_tok_s_b{b}']:.2f}x)" if base else ""))
        print(f"{name:<18}{r['kv_bytes_per_token']:>9,}{r['kv_bytes_per_token_llama8b']:>12,}"
              f"{r['tokens_in_budget']:>14,}{r['llama8b_tokens_in_16GB']:>12,}{rate(1):>14}"
              f"{rate(8):>14}{rate(32):>14}" + (
                  f"{r['tiny_tasks_exact'] * r['tiny_tasks_n']:>7.0f}/{r['tiny_tasks_n']}"
                  if "tiny_tasks_n" in r else "      -"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

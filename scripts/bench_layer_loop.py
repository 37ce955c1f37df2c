"""Compile time of one decode step against depth, per layer mode (``EngineConfig.layer_loop``).

    python scripts/bench_layer_loop.py                                  # 4,8,16,32 layers
    python scripts/bench_layer_loop.py --depths 4,32 --modes loop,indexed --out r.json

For each depth the built-in ``default`` model's shape (hidden 256, intermediate 688, 4/2
heads of 64, vocab 320, float32 random weights) with that many layers; for each mode an
``LLMEngine`` (no warm-up, reference attention) lowers and compiles its decode step of
``--rows`` rows, timed apart: trace + lower, then XLA's compile. Also counted in the compiled
HLO: the ops that materialise a whole layer matrix of the stack (``harness.
layer_copies``), i.e. the weight copies the loop makes every layer. "loop" and "indexed"
should stay flat with depth, "unrolled" and "sliced" grow. On CPU "indexed" runs its Pallas
kernel interpreted, so its figures there say how the program grows, not how fast it is.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def measure(depth: int, mode: str, rows: int) -> dict:
    from harness.layer_copies import layer_matrix_copies
    from jserve.engine.config import EngineConfig
    from jserve.engine.engine import LLMEngine
    from jserve.model.weights import DEFAULT_CONFIG, init_params

    cfg = dataclasses.replace(DEFAULT_CONFIG, num_hidden_layers=depth)
    eng = LLMEngine(cfg, init_params(cfg), None, EngineConfig(
        max_num_seqs=max(rows, 4), max_num_batched_tokens=64, max_model_len=256,
        warmup=False, attention_impl="reference", layer_loop=mode,
        enable_prefix_caching=False, compilation_cache_dir=None))
    t0 = clocks()
    lowered, _ = eng.runner.programs.lowering.lower((rows, 0))
    t1 = clocks()
    compiled = lowered.compile()
    t2 = clocks()
    copies = layer_matrix_copies(compiled.as_text(), cfg)
    (lower_s, lower_cpu), (compile_s, compile_cpu) = t1 - t0, t2 - t1
    return {"depth": depth, "mode": mode, "rows": rows, "lower_s": round(lower_s, 2),
            "lower_cpu_s": round(lower_cpu, 2), "compile_s": round(compile_s, 2),
            "compile_cpu_s": round(compile_cpu, 2), "layer_copies": copies,
            "load": round(os.getloadavg()[0], 1)}


def clocks():
    """(wall, this process's CPU time) in seconds: compiling is mostly one thread, so CPU
    time moves far less than wall time with the neighbours' load."""
    import numpy as np
    return np.array([time.perf_counter(), time.process_time()])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="4,8,16,32")
    p.add_argument("--modes", default="loop,indexed,unrolled,sliced")
    p.add_argument("--rows", type=int, default=4, help="decode rows of the step")
    p.add_argument("--out", default=None, help="the rows as JSON")
    a = p.parse_args()
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    results = []
    measure(2, "loop", a.rows)  # untimed: the first compile of a process pays start-up costs
    print("| depth | mode | trace+lower s (CPU s) | compile s (CPU s) | layer-matrix copies "
          "in HLO | load |")
    print("|---|---|---|---|---|---|")
    for depth in (int(d) for d in a.depths.split(",")):
        for mode in a.modes.split(","):
            r = measure(depth, mode, a.rows)
            results.append(r)
            print(f"| {depth} | {mode} | {r['lower_s']} ({r['lower_cpu_s']}) | "
                  f"{r['compile_s']} ({r['compile_cpu_s']}) | {r['layer_copies']} | "
                  f"{r['load']} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"backend": jax.default_backend(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""The CPU engine's settings against each other on the 12-layer bench checkpoint of
``bench_vs_vllm.py`` (``harness.bench_checkpoint.llama_bpe_checkpoint``: hidden 768, 12/4
heads, vocab 32,000, float32), each variant in its own process, the variants alternated in
every repetition, each figure the median of ``--reps``:

- ``layers``: ``layer_loop="loop"`` (one loop over the stacked weights, a copy of every layer
  matrix each step on XLA:CPU) against ``"unrolled"`` (CPU ``auto``);
- ``ladder``: the prefill-token ladder growing 4x (an accelerator's) against 2x (a CPU's,
  ``jserve.engine.batch.buckets.ladder_factor``);
- ``budget``: ``max_num_batched_tokens`` 256 (the default) against 1024;
- ``xla``: XLA:CPU as it comes against ``--xla_cpu_use_onednn=true`` (its dots and
  convolutions through oneDNN) and against YNNPACK's fusions off
  (``--xla_cpu_experimental_ynn_fusion_type=``), through ``XLA_FLAGS``.

Per variant: start to ready (the persistent compilation cache off), then after one untimed
request: TTFT of a 128-token prompt, TPOT over 128 new tokens, and offline output tok/s
(``--prompts`` x 256-token prompts, 128 new tokens each, greedy, EOS ignored); and whether the
TPOT request's 129 greedy tokens equal the first variant's.

    python scripts/bench_cpu_settings.py [--compare layers,ladder,budget,xla] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

VARIANTS = {"layers": [("loop", {"layer_loop": "loop"}), ("unrolled", {"layer_loop": "unrolled"})],
            "ladder": [("4x", {"ladder": 4}), ("2x", {"ladder": 2})],
            "budget": [("256", {"max_num_batched_tokens": 256}),
                       ("1024", {"max_num_batched_tokens": 1024})],
            "xla": [("as it comes", {}), ("onednn", {"xla_flags": "--xla_cpu_use_onednn=true"}),
                    ("no ynn fusions", {"xla_flags": "--xla_cpu_experimental_ynn_fusion_type="})]}


def child(spec: dict) -> dict:
    """One variant's figures (runs in its own process)."""
    import os

    import numpy as np

    if "xla_flags" in spec:  # before JAX is imported
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {spec.pop('xla_flags')}"
    t0 = time.perf_counter()
    ladder = spec.pop("ladder", None)
    if ladder is not None:  # the factor the engine's geometry reads
        from jserve.engine.build import factory
        factory.ladder_factor = lambda platform: ladder
    from jserve import SamplingParams
    from jserve.llm import LLM

    prompts = spec.pop("prompts")
    llm = LLM(spec.pop("model"), dtype="float32", max_model_len=4096, max_num_seqs=64,
              compilation_cache_dir=None, **spec)
    start = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    ids = lambda n: {"prompt_token_ids": rng.integers(3, 31000, n).tolist()}  # noqa: E731
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731

    tokens = []

    def seconds(reqs, new):
        t = time.perf_counter()
        outs = llm.generate(reqs, greedy(new), use_tqdm=False)
        tokens[:] = list(outs[0].token_ids)
        return time.perf_counter() - t

    seconds([ids(128)], 2)  # the first request's one-time costs (a native kernel's load)
    ttft = seconds([ids(128)], 1)
    tpot = (seconds([ids(128)], 129) - ttft) / 128
    decoded = list(tokens)
    offline = prompts * 128 / seconds([ids(256) for _ in range(prompts)], 128)
    return dict(start_s=start, ttft_ms=1e3 * ttft, tpot_ms=1e3 * tpot, offline_tok_s=offline,
                tokens=decoded)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", default="layers,ladder,budget")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="offline prompts")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    from harness.bench_checkpoint import llama_bpe_checkpoint
    from harness.machine import uptime

    model = str(llama_bpe_checkpoint())
    print(f"{model}; {uptime()}")
    for name in a.compare.split(","):
        runs: dict[str, list[dict]] = {label: [] for label, _ in VARIANTS[name]}
        for rep in range(a.reps):
            order = VARIANTS[name] if rep % 2 == 0 else VARIANTS[name][::-1]
            for label, kwargs in order:
                spec = json.dumps({**kwargs, "model": model, "prompts": a.prompts})
                out = subprocess.run([sys.executable, __file__, "--child", spec], check=True,
                                     capture_output=True, text=True).stdout
                runs[label].append(json.loads(out.strip().splitlines()[-1]))
                print(f"{name} {label} rep {rep + 1}: {runs[label][-1]}", flush=True)
        print(f"\n{name} (medians of {a.reps})\n\n| variant | start s | TTFT ms | TPOT ms | "
              "offline tok/s | same tokens |\n|---|---:|---:|---:|---:|---|")
        first = next(iter(runs.values()))[0]["tokens"]
        for label, rows in runs.items():
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "tokens"}
            same = all(r["tokens"] == first for r in rows)
            print(f"| {label} | {med['start_s']:.1f} | {med['ttft_ms']:.1f} | "
                  f"{med['tpot_ms']:.2f} | {med['offline_tok_s']:.1f} | {same} |")
    print(f"\n{uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

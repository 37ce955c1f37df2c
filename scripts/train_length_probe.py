"""Train the TRAIL output-length probe for a model: generate greedy answers to task prompts,
take every layer's embeddings of each finished sequence (the mean prompt embedding and one per
generated token, with the tokens still to come as the target), train one probe per candidate
layer with optax, and keep the layer whose smoothed predictions have the lowest mean absolute
error on held-out requests.

    python scripts/train_length_probe.py                       # tiny-tasks, ships the probe
    python scripts/train_length_probe.py --model default --requests 40 --max-tokens 32 \\
        --out /tmp/probe.npz                                   # plumbing on the random model
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import jax
import numpy as np

from jserve import LLM
from jserve.probe import train_probe
from jserve.probe.dataset import collect, held_out_mae, make_bins, stack


def task_prompts(n: int, seed: int) -> list[str]:
    from jserve.train.length_task import format_prompt, sample_tasks

    return [format_prompt(t.prompt) for t in sample_tasks(n, seed)]


def fingerprint(llm: LLM) -> str:
    """Which weights the probe was trained on (a probe only fits its own model)."""
    h = hashlib.sha1()
    for leaf in jax.tree.leaves(llm.engine.runner.params):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-tasks")
    ap.add_argument("--requests", type=int, default=800, help="training requests")
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=500)
    ap.add_argument("--layers", default="all", help="comma-separated 0-based layers, or all")
    ap.add_argument("--bins", choices=("equal", "log"), default="equal")
    ap.add_argument("--num-bins", type=int, default=10)
    ap.add_argument("--max-len", type=float, default=512)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--prompt-repeat", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default="jserve/assets/probes/tiny_tasks_probe.npz")
    args = ap.parse_args(argv)

    llm = LLM(args.model, max_num_seqs=32, max_num_batched_tokens=256, max_prefill_seqs=8,
              max_model_len=args.max_model_len, warmup=False)
    t0 = time.perf_counter()
    data = collect(llm, task_prompts(args.requests, args.seed), args.max_tokens)
    lengths = [len(r) for _, r in data]
    print(f"collected {len(data)} requests ({sum(lengths)} pairs per layer, output length "
          f"mean {np.mean(lengths):.1f}, max {max(lengths)}) in {time.perf_counter() - t0:.0f}s")
    n_val = max(1, int(len(data) * args.val_fraction))
    train, val = data[n_val:], data[:n_val]
    num_layers = data[0][0].shape[0]
    layers = range(num_layers) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    bins = make_bins(args.bins, args.num_bins, args.max_len)
    results = {}
    best = None
    for layer in layers:
        x, y = stack(train, layer, args.prompt_repeat)
        probe, losses = train_probe(x, y, bins, layer, steps=args.steps, seed=args.seed,
                                    prior_mean=float(np.mean([len(r) for _, r in train])))
        mae = held_out_mae(probe, val, layer)
        results[layer] = mae
        print(f"layer {layer}: loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-50:]):.3f}; "
              f"held-out MAE " + ", ".join(f"{k} {v:.1f}" for k, v in mae.items()), flush=True)
        if best is None or mae["refined"] < results[best[0]]["refined"]:
            best = (layer, probe)
    best[1].save(args.out)
    with open(args.out.removesuffix(".npz") + ".json", "w") as f:  # what eval reports
        json.dump({"model": args.model, "model_fingerprint": fingerprint(llm),
                   "best_layer": best[0], "requests": len(data),
                   "held_out_requests": n_val, "steps": args.steps,
                   "bins": list(bins.edges), "mae": {str(k): v for k, v in results.items()}},
                  f, indent=1)
    print(json.dumps({"best_layer": best[0], "out": args.out,
                      "mae": {str(k): v for k, v in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A decode step against the f32 matmul ceiling of this machine, per batch size.

    python scripts/profile_step.py [--model bench | bench-32k | NAME | DIR]
                                   [--batches 1,8,32 | --batch B] [--prompt-len 128] [--reps 5]
                                   [--overlap] [--split-ab] [--host-phases]

For each batch size B: ``B`` requests (greedy unless ``--temperature``) on ``--model``
(default the bench model of
``bench_engine.py``: 4 layers, hidden 512, GQA 8/2, vocab 8192, f32, random weights;
``bench-32k``: the same shape with a 32,768-token vocabulary, a HF checkpoint transformers
writes once into ~/.cache/jserve/bench; or any built-in name or checkpoint directory
``jserve serve --model`` takes, read as f32) through one engine, ``--reps`` times; the
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
(``HostPhases``): XLA's worker threads fill both cores, so this CPU adds onto the step; with
``--decode-burst K`` too, again with each engine step a burst of K tokens, per token.
"""
from __future__ import annotations

import argparse

import jax
from tqdm import tqdm

from harness.decode_step import bench_model
from harness.machine import uptime
from harness.step_profile import profile_batch, report
from jserve.kernels import resolve_impl


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="bench",
                    help="bench (the bench model), bench-32k (its shape, 32K vocabulary), or "
                         "a built-in name or checkpoint directory")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--batch", type=int, default=None, help="one batch size (overrides --batches)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=40, help="new tokens per request")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the requests' temperature (0: greedy, the plain argmax)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p")
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
    ap.add_argument("--loop-ab", action="store_true",
                    help="also time the device-only all-decode step compiled without the "
                         "decode-burst loop (decode_burst 1), alternated with the engine's")
    ap.add_argument("--overlap", action="store_true",
                    help="also run synchronous scheduling and probe the dispatch gaps")
    a = ap.parse_args()
    batches = [a.batch] if a.batch else [int(b) for b in a.batches.split(",")]
    print(f"load at start: {uptime()}")
    model = bench_model(a.model)
    print(f"model {a.model}: vocab {model[0].vocab_size}, hidden {model[0].hidden_size}, "
          f"{model[0].num_hidden_layers} layers, {model[0].dtype}")
    print(f"jax {jax.__version__} on {jax.default_backend()}; attention_impl {a.attention_impl}"
          f" ({resolve_impl(a.attention_impl)})")
    results = []
    with tqdm(total=len(batches) * (a.reps + 1), desc="profile", unit="run") as bar:
        for batch in batches:
            results.append(profile_batch(batch, a, bar, model))
    for r in results:
        report(r, a.overlap)
    print(f"load at end: {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

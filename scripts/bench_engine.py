"""jserve vs Hugging Face transformers ``generate`` on this CPU: same weights, same prompts.

    python scripts/bench_engine.py                  # full run (several minutes)
    python scripts/bench_engine.py --quick          # smoke version (about a minute)
    python scripts/bench_engine.py --reps 5 --out bench.json
    python scripts/bench_engine.py --threads 1      # torch threads (default: all cores)
    python scripts/bench_engine.py --vocab 32768 --decode-only   # a realistic vocabulary
    python scripts/bench_engine.py --decode-burst 4  # jserve with decode bursts of 4 steps

What it measures (float32 everywhere; torch uses every core this process may run on, XLA
does by default; every number is the median of ``--reps`` repetitions, and each repetition
runs jserve and then HF back to back in the same process):

1. Model: a seeded random ``LlamaForCausalLM`` (4 layers, hidden 512, 8 query / 2 KV heads,
   head_dim 64, intermediate 1536, vocab 8192 or ``--vocab``) written with ``save_pretrained``
   to a temp dir that jserve loads with ``LLM(dir)``. FLOPs per decoded token = 2 x matmul
   params touched (the lm_head included, the embedding lookup not) plus attention, which grows
   with context.
2. Decode tokens/s at batch 1, 8, 32: random 128-token prompts, greedy, EOS ignored, N new
   tokens. HF: batch*(N-1) / (t[generate N] - t[generate 1]), from the medians of the two
   times. jserve, the same quantity from token timestamps: the tokens generated after the
   last request got its first token, over the time from then to the last token.
   The batch-8 case also checks that jserve's greedy tokens equal HF's.
3. Prefill tokens/s: 8 prompts x 512 tokens, one new token, wall time on both sides.
4. Offline: 256 requests with ShareGPT4 lengths (``--trace``: another packaged trace or a
   file; lengths divided by ``--length-scale``, clipped), all submitted at once to jserve's
   continuous batching; HF serves them in arrival order in static batches of 32,
   left-padded, each batch running to its longest output. Only each request's own output
   tokens count as useful.
5. Batch-32 decode against a compute ceiling: jserve's steady-state step time (all 32
   sequences decoding) against FLOPs per step at the f32 matmul rate of this machine,
   measured in the same run (the step's weight matrices at batch 32, one after another:
   ``decode_step.MatmulCeiling``, as ``scripts/profile_step.py`` measures it).

jserve compiles every bucket before timing (``warmup=True``; not timed) and each measurement
runs once untimed on both sides first. Timings move with whatever else runs on the machine
(the load average is printed at start and end). OMP_WAIT_POLICY defaults to PASSIVE for
torch (see below); ``OMP_WAIT_POLICY=ACTIVE python scripts/bench_engine.py`` to compare.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
# Before torch starts OpenMP: with libgomp's spinning waits, torch's threads slowed down up to
# 10x (and erratically) whenever another process or XLA's own threads held a core of this
# small shared machine; passive waits kept HF's times steady. Override by setting it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from harness.hf_compare import Settings, run  # noqa: E402  (imports torch)


def settings_from_args(args: argparse.Namespace) -> Settings:
    if args.quick:
        return Settings(
            reps=args.reps if args.reps_given else 1, decode_batches=(1, 8),
            decode_prompt_len=32, decode_new_tokens=8, correctness_batch=8,
            prefill_batch=2, prefill_len=128, offline_requests=16,
            length_scale=args.length_scale if args.length_scale_given else 32.0,
            prompt_clip=(4, 128), output_clip=(1, 16), hf_batch=8,
            engine=dict(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_seqs=4,
                        max_model_len=256), trace=args.trace)
    return Settings(
        reps=args.reps, decode_batches=(1, 8, 32), decode_prompt_len=128, decode_new_tokens=64,
        correctness_batch=8, prefill_batch=8, prefill_len=512, offline_requests=256,
        length_scale=args.length_scale, prompt_clip=(4, 1024), output_clip=(1, 256), hf_batch=32,
        engine=dict(max_num_seqs=32, max_num_batched_tokens=512, max_prefill_seqs=4,
                    max_model_len=2048), trace=args.trace)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke version")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per metric (default 3; "
                    "1 with --quick)")
    ap.add_argument("--length-scale", type=float, default=None,
                    help="trace lengths are divided by this (default 8; 32 with --quick)")
    ap.add_argument("--trace", default="sharegpt4", help="the offline requests' lengths: "
                    "sharegpt4, azure-conv or a CSV/JSONL trace")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: every core this process may run on)")
    ap.add_argument("--vocab", type=int, default=8192, help="the model's vocabulary size")
    ap.add_argument("--decode-only", action="store_true",
                    help="decode rates and the batch-32 ceiling only (no prefill, no offline)")
    ap.add_argument("--decode-burst", default=None, type=lambda v: v if v == "auto" else int(v),
                    help="jserve's decode_burst (default: the engine's own, \"auto\")")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = ap.parse_args()
    args.reps_given, args.length_scale_given = args.reps is not None, args.length_scale is not None
    args.reps = 3 if args.reps is None else args.reps
    args.length_scale = 8.0 if args.length_scale is None else args.length_scale
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    s = settings_from_args(args)
    burst = {} if args.decode_burst is None else {"decode_burst": args.decode_burst}
    s = dataclasses.replace(s, vocab_size=args.vocab, decode_only=args.decode_only,
                            engine={**s.engine, **burst})
    return run(s, args.threads, args.quick, args.out)


if __name__ == "__main__":
    sys.exit(main())

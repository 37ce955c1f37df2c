"""The one command to run whenever a GPU or TPU is at hand: kernels, engine and speed.

    python scripts/device_check.py                  # full check on the GPU/TPU (default there)
    python scripts/device_check.py --smoke          # tiny CPU version (default on CPU; CI test)
    python scripts/device_check.py --smoke --write-docs   # ... and write docs/device.{md,json}
    python scripts/device_check.py --skip-timings --contexts 1024,4096   # correctness only

Full mode (the default when ``jax.default_backend()`` is gpu or tpu); every check gets a
status, ``pass`` or ``fail``, and the exit status is non-zero if any failed:

1. Kernels: the backend's Pallas kernel (``pallas_gpu`` on GPU, ``pallas_tpu`` on TPU),
   compiled, against the XLA reference at Llama-3-8B attention shapes (32 query / 8 KV
   heads, head_dim 128, bf16, 16-token pages scattered at random over the pool), contexts
   1K, 4K, 8K, 32K: a decode batch (32 sequences of mixed length up to the context and a
   padding row), a prefill chunk (512 tokens at the end of the context) and a mixed batch
   (16 decodes, a 256-token chunk at the end of the context, a fresh 128-token prompt,
   padding tokens). Output and log-sum-exp must agree within ``|a - b| <= tol + tol |b|``
   (tol 2e-2 in bf16) and rows without keys must come out 0 / -inf in both; ``write_kv``
   must write what the reference scatter writes. Both are timed (median of ``--reps``
   calls after one untimed call, each ended by ``jax.block_until_ready``).
2. Engine: ``LLMEngine`` on random weights with ``attention_impl=<backend kernel>`` against
   ``attention_impl="reference"``, same weights and prompts (mixed lengths, chunked
   prefill, decodes joining and leaving): greedy tokens must be identical. The model is
   float32 and its matmuls run at ``highest`` precision on the accelerator, so the only
   difference between the two runs is the attention implementation (in bf16 a random model's
   near-tied logits would flip on rounding alone); the first mismatch is reported.
3. Timings (not judged) of the engine with the backend kernel on Llama-3.2-1B-shaped and
   Llama-3-8B-shaped random bf16 weights: decode step time at batch 1 and 32 (model bandwidth
   utilisation: bytes of weights + KV read per step / step time / peak bandwidth), prefill
   of a 2K prompt in one chunk (model FLOPs utilisation: model FLOPs / time / peak FLOP/s),
   and a 32K prompt prefilled in 256- vs 2048-token chunks. Step times come from the
   engine's step log (device step plus the token fetch; no host scheduling); every engine
   serves its workload once untimed first (compiles), then once timed.
4. HF transformers' plain ``generate`` on the same decode shapes (random bf16 weights,
   greedy, batch 1 and 32) in a child process: the baseline of the same run.
5. Writes ``docs/device/check.md`` (device, jax version, date, every figure, pass/fail per
   check) and ``--json`` (default ``docs/device/check.json``); ``docs/device.md`` is the
   hand-written account of what the runs showed.

``--budget S`` (default 420 s; 0: none): the run fits in S seconds, on a fresh machine with
an empty compile cache too. Items run most valuable first (kernels, engine tokens, decode at
batch 1 and 32 with and without bursts per model, prefill MFU, the HF baseline, the chunked
long prefill); the JSON is rewritten after every item; an item that would start with too
little time left is skipped, and at the deadline the run ends (exit status 3) with the JSON
and markdown saying what was measured, what was cut short and what was skipped. Every
compile's seconds (or persistent-cache read's) are printed per program; the timing engines
compile their whole program set at start, in parallel.

Smoke mode (``--smoke``; the default on CPU): the same code paths at tiny shapes (4 query /
2 KV heads, head_dim 32, float32, contexts 64 and 256, a 2-layer model), both Pallas
flavours run in interpret mode against the reference, the engine with ``pallas_gpu``
(interpreted) against the reference, and timings of a tiny model that are printed but say
nothing about performance. It writes its report to a temporary directory unless
``--write-docs`` is given, so CI never overwrites docs/device/check.md.

Peak figures come from a table keyed by ``jax.devices()[0].device_kind`` (vendor datasheets;
``--peak-tflops`` / ``--peak-tbps`` override it); for an unknown device the utilisations are
n/a.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's jserve, installed (maybe elsewhere) or not
# JAX takes device memory as it needs it instead of 75% up front, so the HF baseline's child
# process finds room on the same GPU (set it to "true" to measure with preallocation).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from harness.device_check import run  # noqa: E402
from harness.device_profiles import FULL, SMOKE  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true",
                      help="tiny shapes, interpreted kernels (default when the backend is cpu)")
    mode.add_argument("--full", action="store_true",
                      help="real shapes (default when the backend is gpu or tpu)")
    ap.add_argument("--impl", default="auto",
                    help="kernel to check and time: auto is the backend's Pallas kernel; in "
                         "smoke mode auto checks both flavours interpreted, runs the engine "
                         "with pallas_gpu and times the reference")
    ap.add_argument("--contexts", default=None,
                    help="comma-separated kernel-check contexts; unset: "
                         f"{','.join(map(str, FULL.contexts))} (smoke "
                         f"{','.join(map(str, SMOKE.contexts))})")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed calls per kernel figure; unset: {FULL.reps} ({SMOKE.reps} in "
                         "smoke mode)")
    ap.add_argument("--models", default=None,
                    help="comma-separated timing models; unset: "
                         f"{','.join(FULL.timing_models)} (smoke: "
                         f"{','.join(SMOKE.timing_models)})")
    ap.add_argument("--skip-kernels", action="store_true", help="no kernel checks")
    ap.add_argument("--skip-engine", action="store_true", help="no engine token check")
    ap.add_argument("--skip-timings", action="store_true", help="no engine timings")
    ap.add_argument("--skip-hf", action="store_true",
                    help="no HF transformers generate baseline")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds the whole run may take (0: no limit): items run most "
                         "valuable first, one that would start with too little time left "
                         "is skipped, and at the deadline the run ends, writing what it "
                         "measured and what it did not (exit status 3)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="override the device's peak dense bf16 TFLOP/s")
    ap.add_argument("--peak-tbps", type=float, default=None,
                    help="override the device's peak memory bandwidth, TB/s")
    ap.add_argument("--seed", type=int, default=0, help="seeds weights, prompts and cases")
    ap.add_argument("--json", type=Path, default=None,
                    help="results JSON; unset: docs/device/check.json in full mode or with "
                         "--write-docs, else in a new temporary directory")
    ap.add_argument("--md", type=Path, default=None,
                    help="report markdown; unset: docs/device/check.md in full mode or with "
                         "--write-docs, else next to the JSON (smoke)")
    ap.add_argument("--write-docs", action="store_true",
                    help="smoke mode: write docs/device/check.md and check.json too")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    command = " ".join(["python scripts/device_check.py",
                        *(sys.argv[1:] if argv is None else argv)])
    return run(args, command, ROOT / "docs" / "device")


if __name__ == "__main__":
    sys.exit(main())

"""Start-up time, process start to first token: the issue-31 setup by default.

    python scripts/bench_startup.py                      # cold + warm, 4 and 32 layers
    python scripts/bench_startup.py --depths 4 --reps 3 --warmup all
    python scripts/bench_startup.py --setup engine ...   # the older engine-only study

``--setup first-token`` (default): a random HF Llama (hidden 256, intermediate 688, vocab
32000, 4 heads / 2 KV heads of 64) is saved per depth with ``save_pretrained``; every start
is a fresh process that imports jserve, builds ``LLM(<HF dir>)`` and generates 4 greedy
tokens. "cold" uses a new, empty persistent compilation cache, "warm" the same cache again.
Each start reports the engine's own phase breakdown (``jserve.engine.build.startup``: imports =
process start to the engine's construction, weights, KV, programs with cached / compiled /
deferred counts), process start to first token and to the 4th token, JAX's trace / lower /
backend-compile split (monitoring events), and the machine's load before and after.

``--setup engine``: the study in docs/notes/startup.md, "Earlier measurements" (``LLMEngine`` on
``init_params``, every bucket compiled, plus per-component AOT compiles).
"""
from __future__ import annotations

import argparse

# Parent and children import the jserve installed here (this checkout's, in its venv) unless
# PYTHONPATH names another; the children get this checkout's root as PYTHONPATH by default.
from harness.startup import run_child, run_engine_study, run_first_token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--setup", choices=["first-token", "engine"], default="first-token",
                   help="first-token: process start to first token of LLM(<HF dir>) (issue "
                        "31); engine: LLMEngine start and per-component compiles (older study)")
    p.add_argument("--warmup", default="core", choices=["core", "background", "all", "none"],
                   help="first-token setup: the engine's warmup mode")
    p.add_argument("--depths", default="4,32", help="decoder layer counts, comma separated")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--reps", type=int, default=3, help="warm starts per depth (median reported)")
    p.add_argument("--skip-cold", action="store_true",
                   help="no cold start (warm starts then compile into a fresh cache first, "
                        "untimed)")
    p.add_argument("--cold-depths", default=None,
                   help="depths that get a timed cold start (default: all of --depths); the "
                        "others fill their cache untimed before the warm starts")
    p.add_argument("--start-depths", default=None,
                   help="depths that get engine starts (default: all of --depths); the others "
                        "get the trace+lower of every bucket shape only (what a warm start "
                        "redoes), no backend compile")
    p.add_argument("--components-only", action="store_true", help="only the component breakdown")
    p.add_argument("--skip-components", action="store_true", help="no component breakdown")
    p.add_argument("--shapes", default="32x0,0x256,8x128",
                   help="bucket shapes (decodes x prefill tokens) of the component breakdown: "
                        "the engine's largest decode and prefill shapes and a mixed one")
    p.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pool pages (default: the engine's own sizing)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("--verbose", action="store_true", help="tracebacks of failing components")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_depth", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_cache-dir", dest="cache_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_shared", dest="shared", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_model-dir", dest="model_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args._child:
        run_child(args)
    elif args.setup == "first-token":
        run_first_token(args, __file__)
    else:
        run_engine_study(args, __file__)


if __name__ == "__main__":
    main()

"""What prompt logprobs add to a prefill, on the same engine in one run
(``harness.prompt_logprobs``: the method and what is timed).

    python scripts/bench_prompt_logprobs.py [--model default --model DIR ...]
        [--prompt-len 1536] [--reps 9] [--tops 0 1 5] [--json out.json]

The trained-BPE checkpoint of the tests (vocabulary 1216, larger than the default model's
320) is written by ``python -c "import sys; sys.path.insert(0, 'tests'); from pathlib import
Path; from hf_models import write_llama3_chat_checkpoint as w; w(Path('/tmp/llama3-chat'))"``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.prompt_logprobs import measure, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="a --model name or directory "
                    "(repeatable; default: the built-in default model)")
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=9, help="timed runs of each mode (>= 5)")
    ap.add_argument("--tops", type=int, nargs="+", default=[0, 1, 5],
                    help="prompt_logprobs values to time beside none")
    ap.add_argument("--json", help="also write every time measured here")
    args = ap.parse_args()
    results = [measure(m, args.prompt_len, args.reps, tuple(args.tops))
               for m in args.model or ["default"]]
    print(table(results))
    print("load average " + ", ".join(f"{x:.1f}" for x in results[-1]["loadavg"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""The convoy at real length, live: documents of 16K-32K tokens arriving among short chats,
sent over HTTP (the OpenAI completions API, streaming) to a ``jserve serve`` subprocess on
the default model, once per policy (fcfs, sarathi, lars), one fresh server each. Reports the
short requests' TTFT P50/P90 and TPOT, each document's TTFT and completion, and lars against
sarathi: the documents' TTFT ratio (goal <= 1.2x) beside the shorts' gain.

    python scripts/convoy_real_length.py                        # 2 documents, ~15 min on 2 cores
    python scripts/convoy_real_length.py --documents 1 --shorts 8 --short-qps 0.5   # quicker

The scaled-down sweep (documents x1/32-1/48) stays in scripts/convoy_benchmark.py.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from harness.convoy_real import POLICIES, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--documents", type=int, default=2, help="long prompts")
    ap.add_argument("--doc-min", type=int, default=16_384, help="document tokens, at least")
    ap.add_argument("--doc-max", type=int, default=32_768, help="document tokens, at most")
    ap.add_argument("--doc-gap-s", type=float, default=40.0, help="seconds between documents")
    ap.add_argument("--doc-output", type=int, default=16, help="output tokens of a document")
    ap.add_argument("--shorts", type=int, default=24, help="short chats")
    ap.add_argument("--short-qps", type=float, default=0.4, help="short chats' arrival rate")
    ap.add_argument("--short-output-max", type=int, default=64,
                    help="cap on a short chat's output tokens")
    ap.add_argument("--max-model-len", type=int, default=40_960)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="token budget per step: sarathi's chunk, lars's whole chunk")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=Path("bench-out/convoy_real"))
    a = ap.parse_args()
    if a.doc_max + a.doc_output > a.max_model_len:
        ap.error("--doc-max + --doc-output must fit --max-model-len")
    run(a)


if __name__ == "__main__":
    main()
